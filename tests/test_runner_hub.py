"""The runner's control flow against an in-memory scheduler: lifecycle, hub pacing, handles, errors."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import anyio
import pytest
from _fake_scheduler import FakeScheduler
from _runner_env import times_out_in_time

from asynctorchx import AsyncRunner
from asynctorchx.runner import PollSettings
from asynctorchx.schedulers.api import DescribeAppResponse, UnknownRoleException
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidRunConfigException,
    MalformedAppHandleException,
    Role,
    UnknownAppException,
    UnknownSchedulerException,
)

FAST = PollSettings(min_interval=0.01, max_interval=0.05, push_safety_interval=0.2)


def make_runner(
    push: bool = False, poll_settings: PollSettings = FAST, **kw: Any
) -> tuple[AsyncRunner, list[FakeScheduler]]:
    made: list[FakeScheduler] = []

    def factory(session_name: str, **params: Any) -> FakeScheduler:
        sched = FakeScheduler(session_name, push=push, **params)
        made.append(sched)
        return sched

    runner = AsyncRunner(
        "test", scheduler_factories={"fake": factory}, poll_settings=poll_settings, **kw
    )
    return runner, made


def app(name: str = "a") -> AppDef:
    return AppDef(name, [Role("worker", image="img", entrypoint="true", num_replicas=2)])


async def test_use_before_open_raises() -> None:
    """Calling an async method on an unopened runner raises a clear RuntimeError."""
    runner, _ = make_runner()
    with pytest.raises(RuntimeError, match="not open"):
        await runner.run(app(), "fake")


async def test_close_twice_and_use_after_close() -> None:
    """close() is idempotent, closes the schedulers, and later use raises RuntimeError."""
    runner, made = make_runner()
    async with runner:
        await runner.run(app(), "fake")
    await runner.close()
    assert made[0].closed
    with pytest.raises(RuntimeError, match="closed"):
        await runner.status("fake://test/fake-0")
    with pytest.raises(RuntimeError, match="closed"):
        await runner.open()


async def test_handle_shape_and_status() -> None:
    """run() returns '{scheduler}://{session}/{app_id}' and status() reads the backend."""
    runner, _ = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        assert handle == "fake://test/fake-0"
        status = await runner.status(handle)
        assert status is not None and status.state == AppState.RUNNING


async def test_bad_handles() -> None:
    """Malformed handles, unknown schedulers and handles of another session raise the documented errors."""
    runner, _ = make_runner()
    async with runner:
        with pytest.raises(MalformedAppHandleException):
            await runner.status("nonsense")
        with pytest.raises(UnknownSchedulerException, match="fake"):
            await runner.status("nope://test/x")
        with pytest.raises(UnknownAppException, match="session 'other'"):
            await runner.status("fake://other/x")


async def test_unknown_app() -> None:
    """An unknown app gives None from status/wait/describe and UnknownAppException from log_lines."""
    runner, _ = make_runner()
    async with runner:
        assert await runner.status("fake://test/missing") is None
        assert await runner.wait("fake://test/missing", timeout=5) is None
        assert await runner.describe("fake://test/missing") is None
        with pytest.raises(UnknownAppException):
            async for _ in runner.log_lines("fake://test/missing", "worker"):
                pass


async def test_unknown_scheduler_lists_available() -> None:
    """dryrun on an unknown scheduler names the available ones before anything is launched."""
    runner, made = make_runner()
    with pytest.raises(UnknownSchedulerException, match="available: fake"):
        runner.dryrun(app(), "slurmm")
    assert made == []


async def test_bad_cfg_names_option() -> None:
    """A cfg value of the wrong type names the run option and its type."""
    runner, _ = make_runner()
    with pytest.raises(InvalidRunConfigException, match="'speed' must be of type int"):
        runner.dryrun(app(), "fake", {"speed": "fast"})


async def test_wait_timeout_leaves_app_running() -> None:
    """wait(timeout=) raises TimeoutError and the app keeps running."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        with pytest.raises(TimeoutError):
            await runner.wait(handle, timeout=0.1)
        assert made[0].apps["fake-0"].state == AppState.RUNNING


async def test_cancelling_waiter_leaves_app_running() -> None:
    """Cancelling the task that awaits wait() does not cancel the app."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        task = asyncio.create_task(runner.wait(handle))
        await made[0].wait_described("fake-0")  # the hub has seen it RUNNING: the waiter waits
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert made[0].apps["fake-0"].state == AppState.RUNNING
        made[0].set_state("fake-0", AppState.SUCCEEDED)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.parametrize("push", [False, True])
async def test_many_waiters_share_one_round_per_tick(push: bool) -> None:
    """200 concurrent waiters cost one describe_many per round, never one describe per waiter."""
    runner, made = make_runner(push=push)
    async with runner:
        handles = [await runner.run(app(), "fake") for _ in range(200)]
        waiters = [asyncio.create_task(runner.wait(h, timeout=10)) for h in handles]
        sched = made[0]
        # every app was seen RUNNING before any finishes, so the waiters really wait on the hub
        await sched.wait_described(*sched.apps)
        assert not any(w.done() for w in waiters)
        for app_id in list(sched.apps):
            sched.set_state(app_id, AppState.SUCCEEDED)
        results = await asyncio.gather(*waiters)
        assert all(r is not None and r.state == AppState.SUCCEEDED for r in results)
        hub = runner.hub("fake")
        assert len(sched.describe_many_calls) == hub.rounds
        assert sched.describe_calls == sum(len(c) for c in sched.describe_many_calls)
        # far fewer rounds than waiters: the rounds are shared
        assert hub.rounds < 50


async def test_push_wakes_without_polling() -> None:
    """With a pushing backend, a change is seen at once although the safety poll is slow."""
    made: list[FakeScheduler] = []

    def factory(session_name: str, **params: Any) -> FakeScheduler:
        made.append(FakeScheduler(session_name, push=True))
        return made[-1]

    slow = PollSettings(min_interval=10, max_interval=10, push_safety_interval=30)
    async with AsyncRunner(
        "test", scheduler_factories={"fake": factory}, poll_settings=slow
    ) as runner:
        handle = await runner.run(app(), "fake")
        waiter = asyncio.create_task(runner.wait(handle, timeout=5))
        # the first round saw it RUNNING; the next poll is 10 s away, so only the push can wake it
        await made[0].wait_described("fake-0")
        made[0].set_state("fake-0", AppState.FAILED)
        status = await waiter
        assert status is not None and status.state == AppState.FAILED


async def test_as_completed_order() -> None:
    """as_completed yields apps in the order they finish."""
    runner, made = make_runner(push=True)
    async with runner:
        handles = [await runner.run(app(), "fake") for _ in range(3)]
        order = ["fake-2", "fake-0", "fake-1"]
        seen: list[str] = []
        # each app finishes only once the previous one was yielded, so the order they finish in is
        # exactly ``order``
        made[0].set_state(order[0], AppState.SUCCEEDED)
        async for h, _ in runner.as_completed(handles, timeout=5):
            seen.append(h.rsplit("/", 1)[1])
            if len(seen) < len(order):
                made[0].set_state(order[len(seen)], AppState.SUCCEEDED)
        assert seen == order


async def test_watch_reports_transitions_and_restarts() -> None:
    """watch yields the first state, a restart, and the terminal state, then stops."""
    runner, made = make_runner(push=True)
    async with runner:
        handle = await runner.run(app(), "fake")
        events = []
        # each change is made once the event before it was seen, so none can be coalesced away
        changes = [
            lambda: made[0].set_state("fake-0", AppState.RUNNING, num_restarts=1),
            lambda: made[0].set_state("fake-0", AppState.FAILED),
        ]
        with anyio.fail_after(5):
            async for event in runner.watch([handle]):
                events.append((event.state, event.num_restarts))
                if changes:
                    changes.pop(0)()
        assert events == [(AppState.RUNNING, 0), (AppState.RUNNING, 1), (AppState.FAILED, 1)]


async def test_cancel_and_list_and_describe() -> None:
    """cancel reaches the backend, list fills in handles, describe returns the roles."""
    runner, _ = make_runner()
    async with runner:
        handle = await runner.run(app("x"), "fake")
        await runner.cancel(handle)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.CANCELLED
        listed = await runner.list("fake")
        assert [a.app_handle for a in listed] == [handle]
        described = await runner.describe(handle)
        assert described is not None and [r.name for r in described.roles] == ["worker"]


async def test_log_lines_unknown_role() -> None:
    """log_lines names the unknown role and passes lines through otherwise."""
    runner, _ = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        lines = [line async for line in runner.log_lines(handle, "worker", k=1)]
        assert lines == [f"worker/1 line {i}\n" for i in range(3)]
        with pytest.raises(UnknownRoleException, match="no role 'ps'"):
            async for _ in runner.log_lines(handle, "ps"):
                pass


async def test_hub_forgets_the_oldest_final_apps_and_describes_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond the cap, the oldest final entries are dropped; waiting on one again re-describes it."""
    from asynctorchx.runner import hub as hub_module

    monkeypatch.setattr(hub_module, "_MAX_FINAL_ENTRIES", 2)
    runner, made = make_runner()
    async with runner:
        handles = [await runner.run(app(), "fake") for _ in range(3)]
        sched = made[0]
        for app_id in list(sched.apps):
            sched.set_state(app_id, AppState.SUCCEEDED)
        for handle in handles:
            status = await runner.wait(handle, timeout=5)
            assert status is not None and status.state == AppState.SUCCEEDED
        hub = runner.hub("fake")
        assert hub.entry("fake-0") is None  # the oldest of three, over a cap of two
        assert hub.entry("fake-1") is not None and hub.entry("fake-2") is not None
        assert hub._live_ids() == []
        calls = len(sched.describe_many_calls)
        status = await runner.wait(handles[0], timeout=5)
        assert status is not None and status.state == AppState.SUCCEEDED
        assert len(sched.describe_many_calls) > calls  # asked the backend again


async def test_closing_the_runner_ends_as_completed_and_watch() -> None:
    """as_completed and watch waiting on running apps raise RuntimeError when the runner closes."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        started = asyncio.Event()

        async def completed() -> None:
            async for _ in runner.as_completed([handle]):
                pass

        async def watched() -> None:
            async for _ in runner.watch([handle]):
                started.set()

        tasks = [asyncio.create_task(completed()), asyncio.create_task(watched())]
        await asyncio.wait_for(started.wait(), 5)  # watch saw RUNNING: both are waiting now
        await made[0].wait_described("fake-0")
        assert not any(t.done() for t in tasks)
    for task in tasks:
        with pytest.raises(RuntimeError, match="runner was closed"):
            await asyncio.wait_for(task, 5)


# -- TorchX parity: stop, wait(wait_interval=), cfg_from_str(*strings) --------------------------


async def test_stop_is_cancel() -> None:
    """stop(), TorchX's older name, cancels the app like cancel()."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        await runner.stop(handle)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.CANCELLED
        assert made[0].apps["fake-0"].state == AppState.CANCELLED


async def until_hinted(runner: AsyncRunner, expected: float) -> None:
    """Waits (bounded) until the hub's polling cap is ``expected`` (the waits have registered)."""
    with anyio.fail_after(5):
        while runner.hub("fake").max_interval() != expected:
            await asyncio.sleep(0.001)


async def test_wait_interval_of_every_waiter_sets_the_polling_cap() -> None:
    """A lone waiter's wait_interval becomes the polled backend's cap, even above the default."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        assert runner.hub("fake").max_interval() == FAST.max_interval
        waiter = asyncio.create_task(runner.wait(handle, timeout=5, wait_interval=30))
        await until_hinted(runner, 30)
        second = asyncio.create_task(runner.wait(handle, timeout=5, wait_interval=7))
        await until_hinted(runner, 7)  # the shortest hint wins
        made[0].set_state("fake-0", AppState.SUCCEEDED)
        await runner.status(handle)  # feeds the hub: both waiters return without a 7 s poll
        for task in (waiter, second):
            status = await task
            assert status is not None and status.state == AppState.SUCCEEDED
        assert runner.hub("fake").max_interval() == FAST.max_interval


async def test_waiter_without_hint_keeps_the_default_cap() -> None:
    """A hint longer than the default does not slow polling for a waiter that gave none."""
    runner, _ = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        plain = asyncio.create_task(runner.wait(handle, timeout=5))
        hinted = asyncio.create_task(runner.wait(handle, timeout=5, wait_interval=30))
        with anyio.fail_after(5):
            while not runner.hub("fake")._hints:
                await asyncio.sleep(0.001)
        assert runner.hub("fake").max_interval() == FAST.max_interval
        await runner.cancel(handle)
        for task in (plain, hinted):
            status = await task
            assert status is not None and status.state == AppState.CANCELLED


async def test_short_wait_interval_speeds_up_a_slow_hub() -> None:
    """With a 10 s default poll, wait(wait_interval=0.02) polls every 0.02 s while it waits."""
    slow = PollSettings(min_interval=10, max_interval=10, push_safety_interval=30)
    runner, made = make_runner(poll_settings=slow)
    async with runner:
        handle = await runner.run(app(), "fake")
        waiter = asyncio.create_task(runner.wait(handle, wait_interval=0.02))
        await until_hinted(runner, 0.02)
        rounds = len(made[0].describe_many_calls)
        with anyio.fail_after(5):  # a 10 s cadence could not make 3 more rounds in time
            while len(made[0].describe_many_calls) < rounds + 3:
                await asyncio.sleep(0.005)
        made[0].set_state("fake-0", AppState.SUCCEEDED)
        with anyio.fail_after(5):
            status = await waiter
        assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True])
async def test_bad_wait_interval_is_rejected(bad: Any) -> None:
    """wait_interval must be a positive finite number; the error names the value."""
    runner, _ = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        with pytest.raises(ValueError, match="wait_interval must be a positive number"):
            await runner.wait(handle, wait_interval=bad)


async def test_cfg_from_str_takes_several_strings() -> None:
    """cfg_from_str merges several 'k=v' strings, the last value of a key winning (TorchX's newest)."""
    runner, _ = make_runner()
    async with runner:
        assert runner.cfg_from_str("fake") == {}
        assert runner.cfg_from_str("fake", "speed=1", "speed=3") == {"speed": 3}
        with pytest.raises(InvalidRunConfigException, match=r"'speed'.*Given: 'speed'"):
            runner.cfg_from_str("fake", "speed=2", "speed")


async def test_close_finishes_when_its_caller_is_cancelled() -> None:
    """A Task.cancel() of the task running close() does not cut the clean-up short: every scheduler
    is still closed, then the cancellation reaches the caller."""
    release = asyncio.Event()
    entered = asyncio.Event()

    class SlowClose(FakeScheduler):
        async def close(self) -> None:
            entered.set()
            await release.wait()
            await super().close()

    first, second = SlowClose("s"), FakeScheduler("s")
    second.backend = "fake2"
    runner = AsyncRunner(
        name="s",
        scheduler_factories={"fake": lambda *_a, **_k: first, "fake2": lambda *_a, **_k: second},
    )
    await runner.open()
    await runner.run(app(), "fake")
    await runner.run(app(), "fake2")
    closer = asyncio.get_running_loop().create_task(runner.close())
    with anyio.fail_after(5):
        await entered.wait()
    closer.cancel()
    await asyncio.sleep(0)
    release.set()
    with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
        await closer
    assert first.closed and second.closed


class HangingScheduler(FakeScheduler):
    """A FakeScheduler whose status rounds hang forever once ``hang`` is set."""

    hang = False

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        if self.hang:
            await asyncio.Event().wait()
        return await super().describe_many(app_ids)


@pytest.mark.parametrize("call", ["wait", "wait_all"])
async def test_a_wait_timeout_is_kept_when_the_backend_hangs(call: str) -> None:
    """wait/wait_all(timeout=T) on a backend whose status round hangs raise TimeoutError once the
    last look has had PollSettings.deadline_grace (at most final_look_timeout), instead of hanging
    with the round."""
    made: list[HangingScheduler] = []

    def factory(session_name: str, **params: Any) -> HangingScheduler:
        made.append(HangingScheduler(session_name, **params))
        return made[-1]

    timeout = 0.2
    settings = replace(FAST, final_look_timeout=timeout)
    runner = AsyncRunner("test", scheduler_factories={"fake": factory}, poll_settings=settings)
    async with runner:
        handle = await runner.run(app(), "fake")
        await made[0].wait_described("fake-0")
        made[0].hang = True
        hung = "the wait hung with the backend's status round"
        assert await times_out_in_time(runner, handle, call, timeout, guard=50 * timeout), hung


async def test_an_int_timeout_too_large_for_a_float_means_no_limit() -> None:
    """wait/wait_all(timeout=10**400) wait like timeout=None (they raised OverflowError), and
    wait_interval=10**400 is refused like inf, with the ValueError naming it."""
    runner, made = make_runner()
    async with runner:
        handle = await runner.run(app(), "fake")
        waits = [
            asyncio.create_task(runner.wait(handle, timeout=10**400)),
            asyncio.create_task(runner.wait_all([handle], timeout=10**400)),
        ]
        await made[0].wait_described("fake-0")
        made[0].set_state("fake-0", AppState.SUCCEEDED)
        with anyio.fail_after(10):
            single, every = await asyncio.gather(*waits)
        assert single is not None and single.state == AppState.SUCCEEDED
        assert every[handle] is not None and every[handle].state == AppState.SUCCEEDED
        with pytest.raises(ValueError, match=r"wait_interval must be .* got 1000000"):
            await runner.wait(handle, wait_interval=10**400)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_interval": float("nan")}, "min_interval must be a finite number > 0, got nan"),
        ({"min_interval": 0}, "min_interval must be a finite number > 0, got 0"),
        ({"min_interval": -1}, "min_interval must be a finite number > 0, got -1"),
        ({"min_interval": "0.1"}, "min_interval must be a finite number > 0, got '0.1'"),
        ({"max_interval": float("nan")}, "max_interval must be a number > 0, got nan"),
        ({"min_interval": 5, "max_interval": 1}, r"max_interval \(1.0\) must not be below"),
        ({"backoff": 0.5}, "backoff must be a finite number >= 1, got 0.5"),
        ({"push_safety_interval": True}, "push_safety_interval must be a number > 0, got True"),
        ({"unknown_grace": -1}, "unknown_grace must be a number >= 0, got -1"),
        ({"final_look_timeout": float("nan")}, "final_look_timeout must be a number >= 0, got nan"),
    ],
)
def test_bad_poll_settings_are_refused_naming_the_field(
    settings: dict[str, Any], message: str
) -> None:
    """A PollSettings value that is NaN, not a number or out of range raises ValueError naming
    it (a NaN stopped the hub's loop for good; min_interval <= 0 made it poll without pause)."""
    with pytest.raises(ValueError, match=message):
        PollSettings(**settings)


class StrayCancelScheduler(FakeScheduler):
    """A FakeScheduler whose next status round raises CancelledError once ``stray`` is set,
    though nothing cancelled it (a backend bug seen in client libraries)."""

    stray = False

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        if self.stray:
            self.stray = False
            raise asyncio.CancelledError
        return await super().describe_many(app_ids)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="needs Task.cancelling (Python 3.11)")
async def test_a_stray_cancelled_error_from_the_backend_does_not_stop_the_hub() -> None:
    """A status round that raises CancelledError nobody asked for counts as a failed round: the
    hub goes on, and a wait without timeout still sees the app end (it waited forever)."""
    made: list[StrayCancelScheduler] = []

    def factory(session_name: str, **params: Any) -> StrayCancelScheduler:
        made.append(StrayCancelScheduler(session_name, **params))
        return made[-1]

    runner = AsyncRunner("test", scheduler_factories={"fake": factory}, poll_settings=FAST)
    async with runner:
        handle = await runner.run(app(), "fake")
        await made[0].wait_described("fake-0")
        made[0].stray = True
        waiter = asyncio.create_task(runner.wait(handle))
        with anyio.fail_after(10):
            while made[0].stray:
                await asyncio.sleep(0.01)
        made[0].set_state("fake-0", AppState.SUCCEEDED)
        with anyio.fail_after(10):
            status = await waiter
        assert status is not None and status.state == AppState.SUCCEEDED


async def test_watch_ends_when_its_app_vanishes_from_the_backend() -> None:
    """An app the backend stops knowing (purged, lost) while watched: the watch yields its last
    event (UNKNOWN, terminal) and ends, as ``wait`` does, instead of waiting forever (once it has
    been missing for ``missing_rounds`` rounds over ``missing_grace``, here 0 s)."""
    runner, made = make_runner(poll_settings=replace(FAST, unknown_grace=0.0, missing_grace=0.0))
    async with runner:
        handle = await runner.run(app(), "fake")
        events = []
        with anyio.fail_after(10):
            async for event in runner.watch([handle]):
                events.append(event)
                if len(events) == 1:
                    del made[0].apps["fake-0"]  # the backend forgets it
        assert events[-1].state == AppState.UNKNOWN and events[-1].is_terminal
        assert [e.is_terminal for e in events].count(True) == 1


async def test_a_final_entry_dropped_while_listened_to_is_forgotten_once_nobody_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Final entries over the hub's bound while an ``as_completed`` listens to them are kept
    until it ends, then forgotten: a long sweep's hub stays within its bound."""
    from asynctorchx.runner import hub as hub_module

    monkeypatch.setattr(hub_module, "_MAX_FINAL_ENTRIES", 2)
    runner, made = make_runner()
    async with runner:
        handles = [await runner.run(app(), "fake") for _ in range(5)]
        for app_id in list(made[0].apps):
            made[0].set_state(app_id, AppState.SUCCEEDED)
        with anyio.fail_after(10):
            done = [h async for h, _ in runner.as_completed(handles)]
        assert sorted(done) == sorted(handles)
        assert len(runner.hub("fake")._entries) == 2


async def test_a_waiter_without_hint_wakes_the_hub_sleeping_for_a_long_hint() -> None:
    """A polled hub sleeping for another wait's long ``wait_interval`` (30 s): a wait without a
    hint, or an ``as_completed``, that comes meanwhile gets the default cap at once: its app's
    end is seen within ``max_interval``, not after the long sleep."""
    settings = PollSettings(min_interval=0.01, max_interval=0.05, backoff=100)
    runner, made = make_runner(poll_settings=settings)
    async with runner:
        slow_app, plain_app, listened_app = [await runner.run(app(), "fake") for _ in range(3)]
        slow = asyncio.create_task(runner.wait(slow_app, wait_interval=30))
        hub = runner.hub("fake")
        with anyio.fail_after(10):
            while hub._interval < 30:  # the loop now sleeps 30 s between rounds
                await asyncio.sleep(0.01)
        plain = asyncio.create_task(runner.wait(plain_app))

        async def first_completed() -> None:
            async for _ in runner.as_completed([listened_app]):
                return

        listened = asyncio.create_task(first_completed())
        await asyncio.sleep(0)
        made[0].set_state("fake-1", AppState.SUCCEEDED)
        made[0].set_state("fake-2", AppState.SUCCEEDED)
        with anyio.fail_after(5):
            status = await plain
            await listened
        assert status is not None and status.state == AppState.SUCCEEDED
        slow.cancel()
