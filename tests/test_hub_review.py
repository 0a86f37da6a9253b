# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""The StatusHub's fixes of a review of the runner: an app one answer leaves out keeps its state
(for ``PollSettings.missing_grace``), answers are applied in the order they were asked, accounting's
placeholder does not move a Slurm app back, a positive timeout is kept while the status call
hangs, and the hub does not poll while nobody waits.

Against the real Slurm clusters with ``squeue`` made slow, hung or partial by a PATH shim
(``_squeue_shim.py``), and against the in-memory scheduler for the exact sequences. Each test
failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_scheduler import FakeScheduler
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    NOACCT_CONF,
    NOACCT_SETUP_HINT,
    CountingRunner,
    check_cluster,
    job_dir,
    slurm_cluster,
    slurm_runner,
    slurm_session,
)
from _squeue_shim import make_shims, squeue_calls

from asynctorchx import AsyncRunner
from asynctorchx.runner import PollSettings
from asynctorchx.runner.limits import LaunchPhase
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import AppDef, AppState, Resource, Role

FAST = PollSettings(min_interval=0.01, max_interval=0.05, push_safety_interval=0.2)
SMALL = Resource(cpu=1, gpu=0, memMB=64)


# -- helpers ------------------------------------------------------------------------------------


class GatedScheduler(FakeScheduler):
    """A FakeScheduler whose ``describe`` (``runner.status``; the hub's rounds use
    ``describe_many``) reads the app's state at once and answers only once ``release`` is set:
    a slow status call whose answer is old when it arrives. ``leave_out`` holds apps that
    ``describe_many`` answers None for (a partial listing)."""

    def __init__(self, session_name: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.gated = False
        self.read = asyncio.Event()  # the gated describe has read the state
        self.release = asyncio.Event()
        self.leave_out: set[str] = set()
        self.hang_rounds = False
        self.gate_rounds = False  # a round reads the states, then answers once round_release is set
        self.round_read = asyncio.Event()
        self.round_release = asyncio.Event()

    def _answer(self, app_id: str) -> DescribeAppResponse | None:
        resp = self.apps.get(app_id)
        if resp is None:
            return None
        return DescribeAppResponse(
            app_id=resp.app_id, state=resp.state, num_restarts=resp.num_restarts, roles=resp.roles
        )

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        self.describe_calls += 1
        answer = self._answer(app_id)
        if self.gated:
            self.read.set()
            await self.release.wait()
        return answer

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        if self.hang_rounds:
            await asyncio.Event().wait()
        self.describe_many_calls.append(list(app_ids))
        result = {a: None if a in self.leave_out else self._answer(a) for a in app_ids}
        if self.gate_rounds:
            self.gate_rounds = False
            self.round_read.set()
            await self.round_release.wait()
        async with self._described:
            self._described.notify_all()
        return result

    async def rounds_pass(self, n: int, timeout: float = 10) -> None:
        """Returns once ``n`` more ``describe_many`` rounds have answered."""
        target = len(self.describe_many_calls) + n
        with anyio.fail_after(timeout):
            async with self._described:
                await self._described.wait_for(lambda: len(self.describe_many_calls) >= target)


def gated_runner(
    settings: PollSettings = FAST, **kw: Any
) -> tuple[AsyncRunner, list[GatedScheduler]]:
    made: list[GatedScheduler] = []

    def factory(session_name: str, **params: Any) -> GatedScheduler:
        made.append(GatedScheduler(session_name, **params))
        return made[-1]

    runner = AsyncRunner(
        "test", scheduler_factories={"fake": factory}, poll_settings=settings, **kw
    )
    return runner, made


def fake_app(name: str = "a") -> AppDef:
    return AppDef(name, [Role("worker", image="img", entrypoint="true", num_replicas=2)])


def sh(name: str, script: str, replicas: int = 1) -> Role:
    return Role(
        name=name,
        image="/tmp",
        entrypoint="sh",
        args=["-c", script],
        num_replicas=replicas,
        resource=SMALL,
    )


def app_id(handle: str) -> str:
    return handle.rsplit("/", 1)[1]


async def until(pred: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Returns once ``pred()`` holds (checked every 50 ms: a file, a process's state)."""
    with anyio.fail_after(timeout):
        while not pred():
            await asyncio.sleep(0.05)
    assert pred(), what


async def stopped(task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` and waits for its end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def state_of(runner: AsyncRunner, handle: str) -> AppState | None:
    st = await runner.status(handle)
    return None if st is None else st.state


def slurm_state(job: str) -> list[str]:
    """The states Slurm itself gives the job's components (the real squeue, past the shim)."""
    out = subprocess.run(
        ["/usr/bin/squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True
    )
    return out.stdout.split()


@pytest.fixture
def shims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of Slurm command shims first on PATH (its squeue obeys control files)."""
    d = make_shims(tmp_path / "shims")
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    return d


@pytest.fixture
def noacct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test runs on the cluster without accounting."""
    check_cluster(NOACCT_CONF, NOACCT_SETUP_HINT)
    monkeypatch.setenv("SLURM_CONF", NOACCT_CONF)


# -- 1. an app one answer leaves out keeps its state -------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_a_running_app_missing_from_one_squeue_listing_is_not_reported_unknown(
    noacct: None, shims: Path, slurm_runner: CountingRunner, slurm_session: str, job_dir: Path
) -> None:
    """Without accounting, a RUNNING app that one squeue listing leaves out (a partial answer) is
    still RUNNING: a wait on it goes on (it ended at once with UNKNOWN, the job still running)."""
    settings = PollSettings(min_interval=0.1, max_interval=0.5, unknown_grace=1.0)
    async with AsyncRunner(slurm_session, slurm_runner=slurm_runner, poll_settings=settings) as r:
        h = await r.run(AppDef("long", [sh("w", "sleep 40")]), "slurm", {"job_dir": str(job_dir)})
        waiter = asyncio.create_task(r.wait(h))
        try:
            with anyio.fail_after(60):
                while await state_of(r, h) != AppState.RUNNING:
                    await asyncio.sleep(0.3)
            await asyncio.sleep(1.5)  # past unknown_grace: the app is known and running
            hub = r.hub("slurm")
            rounds = hub.rounds
            await until(lambda: hub.rounds > rounds, 10, "a round of the wait")
            (shims / "drop_once").write_text(app_id(h))
            await until(lambda: not (shims / "drop_once").exists(), 10, "the partial listing")
            rounds = hub.rounds
            await until(lambda: hub.rounds >= rounds + 3, 10, "more (complete) rounds")
            assert "RUNNING" in slurm_state(app_id(h))
            assert not waiter.done(), f"the wait ended on one partial listing: {waiter.result()!r}"
            entry = hub.entry(app_id(h))
            assert entry is not None and entry.state == AppState.RUNNING
        finally:
            await stopped(waiter)
            await r.cancel(h)


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_a_slurm_app_squeue_keeps_leaving_out_ends_unknown_after_the_missing_grace(
    noacct: None, shims: Path, slurm_runner: CountingRunner, slurm_session: str, job_dir: Path
) -> None:
    """Without accounting, an app that every squeue listing leaves out from some point on (the
    controller forgot it) still ends UNKNOWN, once missing_grace has passed."""
    settings = PollSettings(
        min_interval=0.1, max_interval=0.3, unknown_grace=0.5, missing_grace=2.0
    )
    async with AsyncRunner(slurm_session, slurm_runner=slurm_runner, poll_settings=settings) as r:
        h = await r.run(AppDef("long", [sh("w", "sleep 60")]), "slurm", {"job_dir": str(job_dir)})
        try:
            with anyio.fail_after(60):
                while await state_of(r, h) != AppState.RUNNING:
                    await asyncio.sleep(0.3)
            await asyncio.sleep(0.6)  # past unknown_grace
            waiter = asyncio.create_task(r.wait(h))
            hub = r.hub("slurm")
            rounds = hub.rounds
            await until(lambda: hub.rounds > rounds, 10, "a round of the wait")
            (shims / "drop").write_text(app_id(h))
            t0 = time.monotonic()
            with anyio.fail_after(30):
                status = await waiter
            assert time.monotonic() - t0 >= settings.missing_grace
            assert status is not None and status.state == AppState.UNKNOWN
            assert "no longer knows" in status.msg
        finally:
            (shims / "drop").write_text("")
            await r.cancel(h)


async def test_an_app_left_out_of_some_answers_keeps_its_state_and_the_wait_goes_on() -> None:
    """An app the backend described leaves some rounds' answers (fewer than missing_rounds in a
    row), and one runner.status() answer: the wait goes on and sees it end (it ended UNKNOWN)."""
    settings = replace(FAST, unknown_grace=0.0, missing_grace=0.0, missing_rounds=3)
    runner, made = gated_runner(settings)
    async with runner:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        await fake.wait_described("fake-0")
        waiter = asyncio.create_task(runner.wait(h))
        entry = runner.hub("fake").entry("fake-0")
        assert entry is not None
        for _ in range(2):  # twice two answers in a row without it, and one with it after each
            fake.leave_out.add("fake-0")
            for _ in range(2):
                await fake.rounds_pass(1)
                assert entry.state == AppState.RUNNING and not entry.final, entry.response
            fake.leave_out.clear()
            await fake.rounds_pass(1)
        del_app = fake.apps.pop("fake-0")
        assert await runner.status(h) is None  # one status answer without it
        fake.apps["fake-0"] = del_app
        await fake.rounds_pass(2)
        assert not waiter.done(), waiter.result()
        assert entry.state == AppState.RUNNING
        fake.set_state("fake-0", AppState.SUCCEEDED)
        with anyio.fail_after(10):
            status = await waiter
        assert status is not None and status.state == AppState.SUCCEEDED


async def test_a_forgotten_app_ends_unknown_after_both_missing_rounds_and_missing_grace() -> None:
    """An app the backend stops knowing for good ends UNKNOWN ("the scheduler no longer knows
    this app"), once it has been missing from missing_rounds answers over missing_grace seconds,
    not before."""
    grace = 0.5
    settings = replace(FAST, unknown_grace=0.0, missing_grace=grace, missing_rounds=3)
    runner, made = gated_runner(settings)
    async with runner:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        await fake.wait_described("fake-0")
        waiter = asyncio.create_task(runner.wait(h))
        await fake.rounds_pass(1)
        calls = len(fake.describe_many_calls)
        fake.leave_out.add("fake-0")
        t0 = time.monotonic()
        with anyio.fail_after(10):
            status = await waiter
        assert time.monotonic() - t0 >= grace
        assert len(fake.describe_many_calls) - calls >= 3
        assert status is not None and status.state == AppState.UNKNOWN
        assert status.msg == "the scheduler no longer knows this app"


async def test_missing_rounds_must_be_an_integer_of_at_least_one() -> None:
    """PollSettings(missing_rounds=0 or 1.5) is refused naming the field."""
    for bad in (0, 1.5, True, "3"):
        with pytest.raises(ValueError, match="missing_rounds must be an integer >= 1"):
            PollSettings(missing_rounds=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing_grace must be a number >= 0"):
        PollSettings(missing_grace=-1)
    with pytest.raises(ValueError, match="deadline_grace must be a number >= 0"):
        PollSettings(deadline_grace=float("nan"))


# -- 2. answers are applied in the order they were asked --------------------------------------


async def test_a_slow_status_answer_does_not_move_the_hub_or_a_watch_backwards() -> None:
    """runner.status() that read PENDING, then answered after a hub round saw RUNNING: the caller
    gets its (old) answer, but the hub keeps RUNNING and a watch never goes back to PENDING (it
    yielded PENDING after RUNNING, then RUNNING again)."""
    runner, made = gated_runner()
    async with runner:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        fake.set_state("fake-0", AppState.PENDING)
        events: list[AppState] = []
        running = asyncio.Event()

        async def watching() -> None:
            async for ev in runner.watch([h]):
                events.append(ev.state)
                if ev.state == AppState.RUNNING:
                    running.set()

        watcher = asyncio.create_task(watching())
        await fake.wait_described("fake-0")
        fake.gated = True
        status = asyncio.create_task(runner.status(h))
        await fake.read.wait()  # it read PENDING
        fake.set_state("fake-0", AppState.RUNNING)
        with anyio.fail_after(10):
            await running.wait()
        fake.release.set()
        answered = await status
        assert answered is not None and answered.state == AppState.PENDING  # its own answer
        await fake.rounds_pass(3)
        entry = runner.hub("fake").entry("fake-0")
        assert entry is not None and entry.state == AppState.RUNNING
        assert events[events.index(AppState.RUNNING) :] == [AppState.RUNNING], events
        await stopped(watcher)


async def test_a_rounds_late_answer_does_not_overwrite_a_newer_status_answer() -> None:
    """The other order: a hub round that read the app before a runner.status() but answered after
    it does not overwrite the status's newer answer (a restart seen, then unseen)."""
    runner, made = gated_runner()
    async with runner:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        await fake.wait_described("fake-0")
        restarts: list[int] = []

        async def watching() -> None:
            async for ev in runner.watch([h]):
                restarts.append(ev.num_restarts)

        watcher = asyncio.create_task(watching())
        fake.gate_rounds = True
        await fake.round_read.wait()  # a round read 0 restarts and has not answered
        fake.set_state("fake-0", AppState.RUNNING, num_restarts=1)
        status = await runner.status(h)
        assert status is not None and status.num_restarts == 1
        fake.round_release.set()
        await fake.rounds_pass(3)
        entry = runner.hub("fake").entry("fake-0")
        assert entry is not None and entry.response is not None
        assert entry.response.num_restarts == 1
        assert restarts == [0, 1], restarts
        await stopped(watcher)


# -- 3. accounting's placeholder does not move a Slurm app back --------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_watch_does_not_go_back_to_pending_when_squeue_misses_a_running_app_with_accounting(
    shims: Path,
    slurm_cluster: None,
    slurm_runner: CountingRunner,
    slurm_session: str,
    job_dir: Path,
) -> None:
    """With accounting, a RUNNING app that squeue leaves out for a few rounds is described from
    sacct, whose lagging placeholder (JobName 'allocation', PENDING) must not be taken as its
    state: watch yields no PENDING after RUNNING (it yielded RUNNING -> PENDING -> RUNNING)."""
    settings = PollSettings(min_interval=0.1, max_interval=0.3)
    async with AsyncRunner(
        slurm_session, slurm_runner=slurm_runner, slurm_accounting=True, poll_settings=settings
    ) as r:
        h = await r.run(AppDef("w2", [sh("w", "sleep 30", 2)]), "slurm", {"job_dir": str(job_dir)})
        events: list[AppState] = []
        running = asyncio.Event()

        async def watching() -> None:
            async for ev in r.watch([h]):
                events.append(ev.state)
                if ev.state == AppState.RUNNING:
                    running.set()

        watcher = asyncio.create_task(watching())
        try:
            with anyio.fail_after(60):
                await running.wait()
            hub = r.hub("slurm")
            (shims / "drop").write_text(app_id(h))
            rounds = hub.rounds
            await until(lambda: hub.rounds >= rounds + 8, 30, "rounds without the app in squeue")
            (shims / "drop").write_text("")
            rounds = hub.rounds
            await until(lambda: hub.rounds >= rounds + 3, 30, "rounds with it again")
            assert "RUNNING" in slurm_state(app_id(h))
            assert events[events.index(AppState.RUNNING) :] == [AppState.RUNNING], events
        finally:
            await stopped(watcher)
            await r.cancel(h)


# -- 4. a positive timeout is kept while the status call hangs ---------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(200)
@pytest.mark.parametrize("call", ["wait", "wait_all", "as_completed"])
async def test_a_wait_timeout_is_kept_while_squeue_hangs(
    call: str,
    shims: Path,
    slurm_cluster: None,
    slurm_runner: CountingRunner,
    slurm_session: str,
    job_dir: Path,
) -> None:
    """README (Reliability): wait(h, timeout=T) with a backend whose status call hangs raises
    TimeoutError at the deadline. With the default PollSettings and a hub round hung in squeue,
    wait/wait_all/as_completed(timeout=1) raised only after T + final_look_timeout (~11 s)."""
    async with AsyncRunner(slurm_session, slurm_runner=slurm_runner) as r:
        hs = [
            await r.run(AppDef("long", [sh("w", "sleep 60")]), "slurm", {"job_dir": str(job_dir)})
            for _ in range(3)
        ]
        waker: asyncio.Task[Any] | None = None
        try:
            with pytest.raises(TimeoutError):
                await r.wait_all(hs, timeout=0)  # every app known
            (shims / "hang").touch()
            before = squeue_calls(shims)
            waker = asyncio.create_task(r.wait(hs[0], wait_interval=0.1))
            await until(lambda: squeue_calls(shims) > before, 10, "a hung round")
            t0 = time.monotonic()
            with anyio.fail_after(60), pytest.raises(TimeoutError):
                if call == "wait":
                    await r.wait(hs[1], timeout=1)
                elif call == "wait_all":
                    await r.wait_all(hs, timeout=1)
                else:
                    async for _ in r.as_completed(hs, timeout=1):
                        pass
            elapsed = time.monotonic() - t0
            # deadline_grace (0.5 s) and a margin
            assert elapsed < 2.5, f"{call}(timeout=1) raised after {elapsed:.1f} s"
        finally:
            if waker is not None:
                await stopped(waker)
            (shims / "hang").unlink(missing_ok=True)
            for h in hs:
                await r.cancel(h)


async def test_a_positive_timeout_waits_for_a_hung_round_only_the_deadline_grace() -> None:
    """A wait(timeout=T) while the hub's round hangs raises TimeoutError within T +
    deadline_grace (it waited final_look_timeout more); timeout=0 still waits up to
    final_look_timeout for its one look."""
    settings = replace(FAST, final_look_timeout=3.0, deadline_grace=0.2)
    runner, made = gated_runner(settings)
    async with runner:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        await fake.wait_described("fake-0")
        fake.hang_rounds = True
        hub = runner.hub("fake")
        rounds = hub.rounds
        waker = asyncio.create_task(runner.wait(h))
        await until(lambda: hub.rounds > rounds, 5, "a hung round")
        for call in ("wait", "wait_all"):
            t0 = time.monotonic()
            with anyio.fail_after(10), pytest.raises(TimeoutError):
                if call == "wait":
                    await runner.wait(h, timeout=0.3)
                else:
                    await runner.wait_all([h], timeout=0.3)
            elapsed = time.monotonic() - t0
            assert 0.3 <= elapsed < 0.3 + 0.2 + 0.5, (call, elapsed)
        t0 = time.monotonic()
        with anyio.fail_after(10), pytest.raises(TimeoutError):
            await runner.wait(h, timeout=0)
        assert time.monotonic() - t0 >= 3.0  # a question: it waited for its look
        await stopped(waker)


async def test_the_last_look_still_reports_an_app_that_ended_just_before_the_deadline() -> None:
    """With a backend that answers at once, an app that ended after the hub's last round but before
    the deadline is returned (not TimeoutError): the last look is kept for positive timeouts."""
    settings = PollSettings(min_interval=30, max_interval=30)  # no round before the deadline
    runner, made = gated_runner(settings)
    async with runner:
        calls = ("wait", "wait_all", "as_completed")
        handles = [await runner.run(fake_app(), "fake") for _ in calls]
        fake = made[0]
        await fake.wait_described(*map(app_id, handles))
        for call, h in zip(calls, handles, strict=True):
            waiting: asyncio.Task[Any]
            t0 = time.monotonic()
            if call == "wait":
                waiting = asyncio.create_task(runner.wait(h, timeout=0.5))
            elif call == "wait_all":
                waiting = asyncio.create_task(runner.wait_all([h], timeout=0.5))
            else:
                waiting = asyncio.create_task(anext(runner.as_completed([h], timeout=0.5)))
            # (time for a round the wait's start may cause: the next one is 30 s away)
            await asyncio.sleep(0.2)
            fake.apps[app_id(h)].state = AppState.SUCCEEDED
            with anyio.fail_after(5):
                result = await waiting
            assert time.monotonic() - t0 >= 0.5  # it came from the last look
            if call == "wait_all":
                result = result[h]
            elif call == "as_completed":
                result = result[1]
            assert result is not None and result.state == AppState.SUCCEEDED, call


# -- 5. the hub does not poll while nobody waits -----------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_the_hub_stops_polling_squeue_once_nobody_waits(
    shims: Path,
    slurm_cluster: None,
    slurm_runner: CountingRunner,
    slurm_session: str,
    job_dir: Path,
) -> None:
    """Once the only wait on an app is cancelled (nobody waits, watches or lists), the hub stops
    asking squeue (it polled every max_interval for as long as the job lived); a wait that
    comes later wakes it, and status() answers meanwhile."""
    settings = PollSettings(min_interval=0.1, max_interval=0.5)
    async with AsyncRunner(slurm_session, poll_settings=settings, slurm_runner=slurm_runner) as r:
        h = await r.run(AppDef("long", [sh("w", "sleep 60")]), "slurm", {"job_dir": str(job_dir)})
        try:
            waiter = asyncio.create_task(r.wait(h))
            hub = r.hub("slurm")
            await until(lambda: hub.rounds >= 2, 30, "rounds of the wait")
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert not hub.awaited()
            await until(lambda: hub._idle, 10, "the hub's idle sleep")
            before, rounds = squeue_calls(shims), hub.rounds
            await asyncio.sleep(2)  # (four max_intervals: nothing must happen)
            assert squeue_calls(shims) == before and hub.rounds == rounds, (
                f"{squeue_calls(shims) - before} squeue calls in 2 s with nobody waiting"
            )
            assert await state_of(r, h) in (AppState.PENDING, AppState.RUNNING)
            assert squeue_calls(shims) == before + 1  # status() asked, the hub did not
            await r.cancel(h)
            with anyio.fail_after(30):
                status = await r.wait(h)
            assert status is not None and status.state == AppState.CANCELLED
        finally:
            await r.cancel(h)


async def test_a_polled_hub_sleeps_while_nobody_waits_and_wakes_for_a_waiter() -> None:
    """A polled hub runs no round while nobody waits; status() reads the backend meanwhile, and a
    wait, an as_completed or a watch that comes wakes it: the app's end is seen at once."""
    runner, made = gated_runner()
    async with runner:
        handles = [await runner.run(fake_app(), "fake") for _ in range(3)]
        fake = made[0]
        await fake.wait_described("fake-0", "fake-1", "fake-2")
        hub = runner.hub("fake")
        await until(lambda: hub._idle, 5, "the hub's idle sleep")
        calls = len(fake.describe_many_calls)
        await asyncio.sleep(0.5)  # ten max_intervals
        assert len(fake.describe_many_calls) == calls
        fake.set_state("fake-0", AppState.SUCCEEDED)
        status = await runner.status(handles[0])
        assert status is not None and status.state == AppState.SUCCEEDED
        assert len(fake.describe_many_calls) == calls
        fake.set_state("fake-1", AppState.FAILED)
        fake.set_state("fake-2", AppState.CANCELLED)
        with anyio.fail_after(5):
            first = await runner.wait(handles[0])
            second = await anext(runner.as_completed([handles[1]]))
            events = [ev.state async for ev in runner.watch([handles[2]])]
        assert first is not None and first.state == AppState.SUCCEEDED
        assert second[1] is not None and second[1].state == AppState.FAILED
        assert events[-1] == AppState.CANCELLED


async def test_a_new_submit_is_followed_until_seen_then_the_hub_sleeps() -> None:
    """A submitted app not yet visible to its backend is due (unknown_grace): the idle hub polls
    until it is seen, then sleeps; launch_events reports the launches all along."""
    settings = replace(FAST, unknown_grace=5.0)
    runner, made = gated_runner(settings)
    async with runner, runner.launch_events() as stream:
        h = await runner.run(fake_app(), "fake")
        fake = made[0]
        hub = runner.hub("fake")
        fake.leave_out.add("fake-0")  # not visible yet
        await fake.rounds_pass(3)
        assert not hub._idle
        fake.leave_out.clear()
        await until(lambda: hub._idle, 5, "the hub's idle sleep once the app was seen")
        entry = hub.entry("fake-0")
        assert entry is not None and entry.known
        phases = []
        with anyio.fail_after(5):
            async for event in stream:
                phases.append(event.phase)
                if event.phase == LaunchPhase.SUBMITTED:
                    assert event.handle == h
                    break
        assert phases == [LaunchPhase.SENT, LaunchPhase.SUBMITTED]


# -- an error no retry mends ends the waits ------------------------------------------------------


class _CommandMissing(FileNotFoundError):
    permanent = True  # (as SlurmNotFoundError: a command that is not installed)


class BrokenScheduler(GatedScheduler):
    """A GatedScheduler whose rounds raise ``error`` while it is set."""

    error: BaseException | None = None

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        if self.error is not None:
            self.describe_many_calls.append(list(app_ids))
            async with self._described:
                self._described.notify_all()
            raise self.error
        return await super().describe_many(app_ids)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["wait", "wait_all", "as_completed", "watch"])
async def test_a_round_error_no_retry_mends_ends_every_wait_with_it(how: str) -> None:
    """Rounds that fail with a permanent error (Slurm's squeue not installed: `asynctorchx wait`
    hung for ever, while status/list/log said so at once) end the waits with that error; a
    passing outage (any other error) keeps them waiting, and an answer clears the error."""
    made: list[BrokenScheduler] = []

    def factory(session_name: str, **params: Any) -> BrokenScheduler:
        made.append(BrokenScheduler(session_name, **params))
        return made[-1]

    settings = FAST
    async with AsyncRunner(
        "test", scheduler_factories={"fake": factory}, poll_settings=settings
    ) as r:
        h = await r.run(fake_app(), "fake")
        fake = made[0]
        await fake.wait_described("fake-0")

        async def waiting() -> object:
            if how == "wait":
                return await r.wait(h)
            if how == "wait_all":
                return await r.wait_all([h])
            if how == "as_completed":
                return [x async for x in r.as_completed([h])]
            return [e async for e in r.watch([h])]

        fake.error = OSError("the controller is restarting")  # a passing outage
        waiter = asyncio.create_task(waiting())
        await fake.rounds_pass(3)
        assert not waiter.done(), waiter
        fake.error = _CommandMissing("the Slurm command 'squeue' was not found")
        with anyio.fail_after(10), pytest.raises(_CommandMissing):
            await waiter
        fake.error = None  # installed again: the next wait sees the app
        fake.set_state("fake-0", AppState.SUCCEEDED)
        with anyio.fail_after(10):
            status = await r.wait(h)
        assert status is not None and status.state == AppState.SUCCEEDED
