"""Per-backend limits: concurrent submits and control-plane calls per second, queued launches, config.

Concurrency is measured inside the scheduler (the scripted backend counts the submits in flight);
rates are checked on a virtual clock shared by the runner's limiter and the backend, so no
assertion depends on real time.
"""

from __future__ import annotations

import asyncio
import decimal
import fractions
import gc
import math
import re
import textwrap
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest
from _runner_env import times_out_in_time

from asynctorchx import AsyncRunner, get_runner
from asynctorchx.runner import LaunchEvent, LaunchPhase, Limits
from asynctorchx.runner.config import apply
from asynctorchx.runner.limits import RateLimiter
from asynctorchx.specs import AppDef, AppState, Role, UnknownSchedulerException
from asynctorchx.testing import AppScript, Fault, ScriptedBackend, VirtualClock

NAME = "scripted"


def app(name: str = "app") -> AppDef:
    return AppDef(name, [Role("main", image="img", entrypoint="main")])


def runner_with(backend: ScriptedBackend, **kw: Any) -> AsyncRunner:
    return AsyncRunner("t", scheduler_factories={NAME: backend}, **kw)


async def drive(clock: VirtualClock, tasks: list[asyncio.Task[Any]]) -> None:
    """Moves the virtual clock to each next timer until every task is done (bounded)."""
    with anyio.fail_after(20):
        while not all(t.done() for t in tasks):
            due = clock.next_due
            if due is not None:
                clock.advance_to(max(due, clock.monotonic()))
            await asyncio.sleep(0)


# -- concurrent submits ----------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "peak"), [(8, 8), (None, 200)])
async def test_the_submit_limit_holds_with_200_concurrent_runs(
    limit: int | None, peak: int
) -> None:
    """200 concurrent run() calls: at most K submits are in flight in the backend (exactly 200 without a limit)."""
    backend = ScriptedBackend(NAME, submit_latency=0.005)
    limits = {NAME: Limits(max_concurrent_submits=limit)} if limit else None
    async with runner_with(backend, limits=limits) as runner:
        with anyio.fail_after(60):
            handles = await asyncio.gather(*(runner.run(app(f"a{i}"), NAME) for i in range(200)))
    assert len(set(handles)) == 200 and len(backend.apps) == 200
    assert backend.max_in_flight_submits == peak


async def test_a_launch_cancelled_while_queued_submits_nothing() -> None:
    """A run() waiting for a submit slot is cancelled at once: the backend never sees its submit."""
    clock = VirtualClock()
    backend = ScriptedBackend(NAME, clock=clock, submit_latency=1)
    async with runner_with(backend, limits={NAME: Limits(max_concurrent_submits=1)}) as runner:
        async with runner.launch_events() as events:
            first = asyncio.create_task(runner.run(app("first"), NAME))
            second = asyncio.create_task(runner.run(app("second"), NAME))
            seen: list[LaunchEvent] = []
            with anyio.fail_after(10):
                async for event in events:
                    seen.append(event)
                    if event.phase == LaunchPhase.QUEUED:
                        break
            assert backend.in_flight_submits == 1
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            await drive(clock, [first])
            with anyio.fail_after(10):
                async for event in events:
                    seen.append(event)
                    if event.phase == LaunchPhase.SUBMITTED:
                        break
        assert first.result() == "scripted://t/first-1"
        assert backend.calls["submit"] == 1 and list(backend.apps) == ["first-1"]
        by_app = {(e.app_name, e.phase) for e in seen}
        assert ("second", LaunchPhase.QUEUED) in by_app
        assert ("second", LaunchPhase.CANCELLED) in by_app
        assert ("second", LaunchPhase.SENT) not in by_app
        queued = next(e for e in seen if e.phase == LaunchPhase.QUEUED)
        assert queued.waiting == 1 and queued.handle is None


async def test_launch_events_follow_a_launch_through_the_queue() -> None:
    """A queued launch reports QUEUED, SENT, SUBMITTED with its handle; a refused one SENT, FAILED."""
    clock = VirtualClock()
    backend = ScriptedBackend(
        NAME,
        clock=clock,
        submit_latency=1,
        faults=[Fault("submit", 3, RuntimeError("quota exceeded"))],
    )
    async with runner_with(backend, limits={NAME: Limits(max_concurrent_submits=1)}) as runner:
        async with runner.launch_events() as events:
            tasks = [asyncio.create_task(runner.run(app(f"a{i}"), NAME)) for i in range(3)]
            await drive(clock, tasks)
        with pytest.raises(RuntimeError, match="quota exceeded"):
            tasks[2].result()
        phases: dict[str, list[LaunchPhase]] = {}
        handles: dict[str, str | None] = {}
        async for event in events:  # closed: what was buffered, then the end
            phases.setdefault(event.app_name, []).append(event.phase)
            if event.phase in (LaunchPhase.SUBMITTED, LaunchPhase.FAILED):
                handles[event.app_name] = event.handle or event.error
    assert phases == {
        "a0": [LaunchPhase.SENT, LaunchPhase.SUBMITTED],
        "a1": [LaunchPhase.QUEUED, LaunchPhase.SENT, LaunchPhase.SUBMITTED],
        "a2": [LaunchPhase.QUEUED, LaunchPhase.SENT, LaunchPhase.FAILED],
    }
    assert handles == {
        "a0": tasks[0].result(),
        "a1": tasks[1].result(),
        "a2": "RuntimeError: quota exceeded",
    }


async def test_launch_events_end_when_the_runner_closes() -> None:
    """An open launch_events() iteration ends (StopAsyncIteration) when the runner closes."""
    runner = runner_with(ScriptedBackend(NAME))
    async with runner:
        events = runner.launch_events()
        reader = asyncio.create_task(anext(events, None))
        await asyncio.sleep(0)
    with anyio.fail_after(5):
        assert await reader is None


async def test_a_launch_events_stream_dropped_without_closing_is_not_kept() -> None:
    """A stream left by ``break`` without ``async with`` is released, not fed every later launch."""
    async with runner_with(ScriptedBackend(NAME)) as runner:
        events = runner.launch_events()
        first = asyncio.create_task(anext(events))
        await runner.run(app("a0"), NAME)
        with anyio.fail_after(5):
            assert (await first).phase is LaunchPhase.SENT
        dropped = weakref.ref(events)
        del events, first
        gc.collect()
        for i in range(100):
            await runner.run(app(f"b{i}"), NAME)
        assert dropped() is None


async def test_a_launched_block_cancelled_while_queued_submits_nothing() -> None:
    """Cancelling a task whose launched() waits for a slot submits nothing and cancels nothing."""
    clock = VirtualClock()
    backend = ScriptedBackend(NAME, clock=clock, submit_latency=1)
    async with runner_with(backend, limits={NAME: Limits(max_concurrent_submits=1)}) as runner:
        first = asyncio.create_task(runner.run(app("first"), NAME))
        entered = asyncio.Event()

        async def block() -> None:
            entered.set()
            async with runner.launched(app("queued"), NAME):
                pytest.fail("the block should not be entered")

        task = asyncio.create_task(block())
        await entered.wait()
        with anyio.fail_after(10):
            while runner._limiters[NAME].waiting == 0:
                await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        await drive(clock, [first])
        assert list(backend.apps) == ["first-1"] and backend.calls["cancel"] == 0


# -- calls per second ------------------------------------------------------------------------------


def max_in_window(times: list[float], window: float) -> int:
    """The most calls in any half-open window ``[t, t + window)``."""
    times = sorted(times)
    return max(sum(1 for u in times if t <= u < t + window - 1e-9) for t in times)


async def test_the_rate_limit_holds_on_every_call() -> None:
    """With 5 calls/s, status, cancel, list, log openings and hub rounds never exceed 5 in any second."""
    clock = VirtualClock()
    backend = ScriptedBackend(
        NAME, AppScript(states=[(0, AppState.RUNNING), (2, AppState.SUCCEEDED)]), clock=clock
    )
    async with runner_with(
        backend, limits={NAME: Limits(max_calls_per_second=5)}, clock=clock
    ) as runner:
        handle = await runner.run(app(), NAME)

        async def logs() -> None:
            async for _ in runner.log_lines(handle, "main"):
                pass

        tasks = [asyncio.create_task(runner.status(handle)) for _ in range(20)]
        tasks += [asyncio.create_task(runner.list(NAME)) for _ in range(3)]
        tasks += [asyncio.create_task(logs()) for _ in range(3)]
        tasks += [asyncio.create_task(runner.wait(handle, timeout=30))]
        tasks += [asyncio.create_task(runner.cancel(handle))]
        await drive(clock, tasks)
        for t in tasks:
            t.result()
    times = [c.time for c in backend.call_log]
    assert backend.calls["describe"] >= 20  # status()
    assert backend.calls["log_iter"] == 3
    assert backend.calls["list"] == 3 and backend.calls["cancel"] == 1
    assert max_in_window(times, 1.0) == 5
    # 1 submit + 20 status + 3 list + 3 log openings + 1 cancel + the hub's rounds, 5 a second
    assert max(times) >= math.floor((len(times) - 1) / 5)


@pytest.mark.parametrize(("rate", "burst", "window"), [(5, 5, 1.0), (0.5, 1, 2.0), (2.5, 2, 0.8)])
async def test_the_rate_limiter_spaces_grants(rate: float, burst: int, window: float) -> None:
    """RateLimiter grants at most floor(R) (at least 1) calls per floor(R)/R seconds, in FIFO order."""
    clock = VirtualClock()
    limiter = RateLimiter(rate, clock)
    assert (limiter.burst, limiter.window) == (burst, pytest.approx(window))
    grants: list[tuple[int, float]] = []

    async def call(i: int) -> None:
        await limiter.acquire()
        grants.append((i, clock.monotonic()))

    tasks = [asyncio.create_task(call(i)) for i in range(12)]
    await drive(clock, tasks)
    assert [i for i, _ in grants] == list(range(12))
    times = [t for _, t in grants]
    assert times == pytest.approx([window * (i // burst) for i in range(12)])
    assert max_in_window(times, window) == burst


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_concurrent_submits": 0}, "max_concurrent_submits must be an integer >= 1 .* got 0"),
        ({"max_concurrent_submits": -3}, "got -3"),
        ({"max_concurrent_submits": 2.5}, "got 2.5"),
        ({"max_concurrent_submits": True}, "got True"),
        ({"max_concurrent_submits": "eight"}, "got 'eight'"),
        ({"max_calls_per_second": 0}, "max_calls_per_second must be a finite number > 0 .* got 0"),
        ({"max_calls_per_second": math.nan}, "got nan"),
        ({"max_calls_per_second": math.inf}, "got inf"),
        ({"max_calls_per_second": 10**400}, "must be a finite number > 0 .* got 1000000"),
        ({"max_calls_per_second": "fast"}, "got 'fast'"),
        ({"max_calls_per_seconds": 1}, "unknown key 'max_calls_per_seconds'"),
    ],
)
def test_bad_limits_name_the_backend_and_the_value(values: dict[str, Any], message: str) -> None:
    """A limit <= 0, NaN, infinite or not a number is a ValueError naming the backend and the value."""
    with pytest.raises(ValueError, match=f"limits of backend 'local_cwd': .*{message}"):
        AsyncRunner("t", limits={"local_cwd": values})


def test_limits_objects_and_unknown_backends() -> None:
    """Limits() checks its fields; limits for a backend that does not exist name it."""
    with pytest.raises(ValueError, match=r"Limits: max_concurrent_submits .* got 0"):
        Limits(max_concurrent_submits=0)
    with pytest.raises(ValueError, match=r"Limits: max_calls_per_second .* got -1"):
        Limits(max_calls_per_second=-1)
    with pytest.raises(UnknownSchedulerException, match="slurmm"):
        AsyncRunner("t", limits={"slurmm": Limits(max_concurrent_submits=2)})
    runner = AsyncRunner("t", limits={"slurm": Limits(4, 2)})
    assert runner.limits("slurm") == Limits(max_concurrent_submits=4, max_calls_per_second=2.0)
    assert runner.limits("local_cwd") is None


def test_limits_take_numbers_of_any_numeric_type() -> None:
    """A Decimal or a Fraction rate (a sweep driver's configuration, numpy's numbers likewise) is
    taken as the number it is, not refused as "not a number"; a non-finite one is still refused
    with its value, and a count must still be an integer."""
    assert Limits(4, decimal.Decimal("2.5")) == Limits(4, 2.5)
    assert Limits(4, fractions.Fraction(5, 2)) == Limits(4, 2.5)
    for bad in (decimal.Decimal("NaN"), decimal.Decimal("-Infinity"), decimal.Decimal("1e400")):
        with pytest.raises(
            ValueError, match=rf"max_calls_per_second .* got {re.escape(repr(bad))}"
        ):
            Limits(max_calls_per_second=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_concurrent_submits must be an integer .* Decimal"):
        Limits(max_concurrent_submits=decimal.Decimal("2.5"))  # type: ignore[arg-type]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project directory as CWD, an empty HOME, TORCHXCONFIG unset."""
    home, proj = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    proj.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(proj)
    monkeypatch.delenv("TORCHXCONFIG", raising=False)
    return proj


def write_config(project: Path, text: str) -> None:
    (project / ".torchxconfig").write_text(textwrap.dedent(text))


def test_limits_from_torchxconfig(project: Path) -> None:
    """[limits:SCHEDULER] sections set get_runner's limits; an explicit limits= wins per backend; run options are untouched."""
    write_config(
        project,
        """
        [local_cwd]
        log_dir = /tmp/x

        [limits:local_cwd]
        max_concurrent_submits = 8
        max_calls_per_second = 5

        [limits:local_dir]
        max_calls_per_second = 0.5
        """,
    )
    runner = get_runner()
    assert runner.limits("local_cwd") == Limits(8, 5.0)
    assert runner.limits("local_dir") == Limits(max_calls_per_second=0.5)
    runner = get_runner(limits={"local_cwd": Limits(max_concurrent_submits=2)})
    assert runner.limits("local_cwd") == Limits(max_concurrent_submits=2)
    assert runner.limits("local_dir") == Limits(max_calls_per_second=0.5)
    # the limits section is neither a run option nor an unknown section (warnings are errors here)
    assert apply("local_cwd", {}) == {"log_dir": "/tmp/x"}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("max_calls_per_second = nan", r"\[limits:slurm\]: .* max_calls_per_second .* got 'nan'"),
        ("max_concurrent_submits = 0", r"\[limits:slurm\]: .* got '0'"),
        ("max_concurent_submits = 4", r"\[limits:slurm\]: .* unknown key 'max_concurent_submits'"),
    ],
)
def test_bad_limits_in_torchxconfig_name_the_section_and_the_value(
    project: Path, section: str, message: str
) -> None:
    """A bad [limits:SCHEDULER] value or key fails get_runner with the section, key and value."""
    write_config(project, f"[limits:slurm]\n{section}\n")
    with pytest.raises(ValueError, match=message):
        get_runner()


def test_an_absurd_rate_is_capped_not_a_crash() -> None:
    """A huge but finite rate (1e300 calls/s) makes a limiter with a bounded burst, not an OverflowError."""
    limiter = RateLimiter(1e300, VirtualClock())
    assert limiter.burst == 100_000 and limiter.window < 1e-290
    assert Limits(max_concurrent_submits=10**18).max_concurrent_submits == 10**18


@pytest.mark.parametrize("call", ["wait", "wait_all"])
async def test_a_wait_timeout_is_kept_when_the_rate_holds_the_last_round_back(call: str) -> None:
    """wait/wait_all(timeout=T) raise TimeoutError at T when the call rate holds the last status
    round back (it waited for the rate slot, up to 1/R later), and make no call beyond the rate."""
    clock = VirtualClock()  # never advanced: the next rate slot never comes
    backend = ScriptedBackend(NAME, clock=clock)
    timeout = 0.5
    async with runner_with(
        backend, limits={NAME: Limits(max_calls_per_second=1)}, clock=clock
    ) as runner:
        handle = await runner.run(app(), NAME)  # takes the only slot of the window
        late = "the wait outlived its timeout, waiting for the rate"
        assert await times_out_in_time(runner, handle, call, timeout, guard=20 * timeout), late
        assert backend.calls["describe"] == backend.calls["describe_many"] == 0


class KeepsSubmitting:
    """A scripted scheduler that, like slurm's, still submits after ``close()``: only the runner
    can stop a launch that reaches it late."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def close(self) -> None:
        self.closed = True


async def test_a_launch_queued_when_the_runner_closes_submits_nothing() -> None:
    """A run() waiting for a submit slot while the runner closes raises 'closed' once it gets
    the slot, without submitting; the run() in flight then returns its handle."""
    clock = VirtualClock()
    backend = ScriptedBackend(NAME, clock=clock, submit_latency=1)
    runner = AsyncRunner(
        "t",
        scheduler_factories={NAME: lambda *a, **k: KeepsSubmitting(backend(*a, **k))},
        limits={NAME: Limits(max_concurrent_submits=1)},
    )
    await runner.open()
    first = asyncio.create_task(runner.run(app("first"), NAME))
    second = asyncio.create_task(runner.run(app("second"), NAME))
    with anyio.fail_after(10):
        while runner._limiters[NAME].waiting == 0:
            await asyncio.sleep(0)
        await runner.close()
    await drive(clock, [first, second])
    assert first.result() == "scripted://t/first-1"
    with pytest.raises(RuntimeError, match=r"the runner (is|was) closed"):
        second.result()
    assert backend.calls["submit"] == 1 and list(backend.apps) == ["first-1"]


async def test_calls_and_launches_waiting_for_the_rate_end_when_the_runner_closes() -> None:
    """A run() queued for a slot and a status() waiting for the call rate raise 'closed' as soon
    as the runner closes (they waited for the slot, up to 1/R), and nothing reaches the backend."""
    clock = VirtualClock()  # never advanced: the next rate slot never comes
    backend = ScriptedBackend(NAME, clock=clock)
    runner = runner_with(
        backend,
        limits={NAME: Limits(max_calls_per_second=1, max_concurrent_submits=1)},
        clock=clock,
    )
    await runner.open()
    handle = await runner.run(app("first"), NAME)  # takes the only call of the window
    queued = [
        asyncio.create_task(runner.run(app("second"), NAME)),
        asyncio.create_task(runner.status(handle)),
    ]
    with anyio.fail_after(10):
        while runner._limiters[NAME].waiting == 0 or backend.calls["describe"]:
            await asyncio.sleep(0)
        await runner.close()
        for task in queued:
            with pytest.raises(RuntimeError, match="closed"):
                await task
    assert backend.calls["submit"] == 1 and backend.calls["describe"] == 0
