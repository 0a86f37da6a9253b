"""Launches take turns with awaited exits (``asynctorchx.runner._pacing``).

The unit tests drive ``LaunchPacer`` with a loop-iteration counter; the last test launches real
local apps in a burst while an exit is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from asynctorchx import AsyncRunner
from asynctorchx.runner import _pacing
from asynctorchx.runner._pacing import LaunchPacer
from asynctorchx.specs.api import AppDef, AppState, Role

pytestmark = pytest.mark.timeout(60)


class Iterations:
    """Counts event-loop iterations (a callback that schedules itself again each time)."""

    def __init__(self) -> None:
        self.number = 0
        self._handle: asyncio.Handle | None = None

    def _tick(self) -> None:
        self.number += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def __enter__(self) -> Iterations:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._handle is not None
        self._handle.cancel()


async def _launches(pacer: LaunchPacer, n: int, it: Iterations) -> list[tuple[int, int]]:
    """Starts ``n`` launches in one iteration; returns (launch, iteration of its turn) in turn
    order."""
    turns: list[tuple[int, int]] = []

    async def launch(i: int) -> None:
        await pacer.turn()
        turns.append((i, it.number))

    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(launch(i))
    return turns


async def test_a_lone_launch_does_not_wait_for_an_iteration() -> None:
    """With nothing else launching, a launch's turn is immediate even while exits are awaited."""
    pacer = LaunchPacer(lambda: True)
    ran: list[str] = []
    asyncio.get_running_loop().call_soon(ran.append, "other callback")
    await pacer.turn()
    assert ran == []  # no loop iteration passed


async def test_without_awaited_exits_a_burst_launches_in_one_iteration() -> None:
    """Nobody waits for an exit: every launch of a burst goes at once (one batch costs least)."""
    pacer = LaunchPacer(lambda: False)
    with Iterations() as it:
        turns = await _launches(pacer, 50, it)
    assert [i for i, _ in turns] == list(range(50))
    assert len({n for _, n in turns}) == 1


async def test_awaited_exits_spread_a_burst_over_iterations_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While an exit is awaited, a burst beyond the budget waits for later iterations (one launch
    per iteration with a zero budget), and turns come in order of arrival."""
    monkeypatch.setattr(_pacing, "BUDGET", 0.0)
    pacer = LaunchPacer(lambda: True)
    with Iterations() as it:
        turns = await _launches(pacer, 20, it)
    assert [i for i, _ in turns] == list(range(20))
    iterations = [n for _, n in turns]
    assert len(set(iterations)) == 20  # each in an iteration of its own
    assert iterations == sorted(iterations)
    assert pacer.waiting == 0


async def test_a_budget_lets_several_launches_share_an_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a budget far above a launch's cost, the waiting launches go several per iteration."""
    monkeypatch.setattr(_pacing, "BUDGET", 10.0)
    pacer = LaunchPacer(lambda: True)
    with Iterations() as it:
        turns = await _launches(pacer, 200, it)
    assert [i for i, _ in turns] == list(range(200))
    assert len({n for _, n in turns}) < 20


async def test_a_cancelled_waiter_is_skipped_and_the_next_one_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch cancelled while waiting for its turn gives it up; one cancelled after its turn
    came uses it; in both cases the launches behind it still get theirs."""
    monkeypatch.setattr(_pacing, "BUDGET", 0.0)
    pacer = LaunchPacer(lambda: True)
    done: list[int] = []

    async def launch(i: int) -> None:
        await pacer.turn()
        done.append(i)

    tasks = [asyncio.create_task(launch(i)) for i in range(5)]
    await asyncio.sleep(0)  # launch 0 went (the iteration's first); 1-4 wait
    assert done == [0]
    assert pacer.waiting == 4
    tasks[2].cancel()  # while waiting
    while len(done) < 2:
        await asyncio.sleep(0)
    assert done == [0, 1]
    # launch 3's turn has come (its future is done) or comes next: cancel it either way
    tasks[3].cancel()
    await asyncio.wait_for(tasks[4], 5)
    assert done == [0, 1, 4]
    assert tasks[2].cancelled() and tasks[3].cancelled()
    assert pacer.waiting == 0


def _app(script: str) -> AppDef:
    return AppDef("pace", [Role("main", image=".", entrypoint="sh", args=["-c", script])])


async def test_an_awaited_exit_is_heard_before_a_burst_of_launches_ends(tmp_path: Path) -> None:
    """An app told to exit as a burst of 150 launches starts is reported to its waiter before the
    last launch of the burst begins: the burst takes turns with the exit instead of filling the
    event loop for its whole length (unpaced, all 150 begin in the burst's first iteration)."""
    go = tmp_path / "go"
    async with AsyncRunner(name="pacing", local_root=str(tmp_path / "state")) as runner:
        await runner.wait(await runner.run(_app("exit 0"), "local_cwd"))  # warm: first launch
        scheduler = runner._scheduler("local_cwd")
        begun = 0
        original = scheduler.schedule

        async def counting(info):  # type: ignore[no-untyped-def]
            nonlocal begun
            begun += 1
            return await original(info)

        scheduler.schedule = counting  # type: ignore[method-assign]
        first = await runner.run(_app(f"until [ -e {go} ]; do sleep 0.01; done"), "local_cwd")
        heard_after: list[int] = []

        async def waiter() -> None:
            status = await runner.wait(first)
            assert status is not None and status.state == AppState.SUCCEEDED
            heard_after.append(begun)

        watching = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the wait is registered: exits are awaited
        assert not watching.done()
        go.touch()
        burst = await asyncio.gather(*(runner.run(_app("exit 0"), "local_cwd") for _ in range(150)))
        await watching
        assert heard_after[0] < 1 + len(burst), heard_after  # heard before the last launch began
        statuses = await runner.wait_all(burst)
        assert all(s is not None and s.state == AppState.SUCCEEDED for s in statuses.values())


async def test_launches_cancelled_while_waiting_for_their_turn_leave_nothing(
    tmp_path: Path,
) -> None:
    """Cancelling a paced burst: every ``run()`` that did not return left no app behind (those
    still waiting for their turn submitted nothing; those cut short mid-launch were undone)."""
    go = tmp_path / "go"
    async with AsyncRunner(name="pacing", local_root=str(tmp_path / "state")) as runner:
        sleeper = await runner.run(_app(f"until [ -e {go} ]; do sleep 0.01; done"), "local_cwd")
        waiting = asyncio.create_task(runner.wait(sleeper))
        await asyncio.sleep(0)  # exits are awaited: launches are paced
        burst = [asyncio.create_task(runner.run(_app("exit 0"), "local_cwd")) for _ in range(60)]
        for _ in range(3):
            await asyncio.sleep(0)
        assert runner._pacer.waiting > 0  # some are still waiting for their turn
        for task in burst:
            task.cancel()
        results = await asyncio.gather(*burst, return_exceptions=True)
        returned = {r for r in results if isinstance(r, str)}
        assert all(isinstance(r, (str, asyncio.CancelledError)) for r in results), results
        assert len(returned) < len(burst)
        listed = {a.app_handle for a in await runner.list("local_cwd")}
        assert listed == returned | {sleeper}
        go.touch()
        await waiting


async def test_launches_are_paced_only_while_a_wait_or_a_listener_is_in_progress(
    tmp_path: Path,
) -> None:
    """``wait`` and ``as_completed`` make exits awaited while they run, and only then: once they
    return (or are left early), bursts start in one go again."""
    go = tmp_path / "go"
    async with AsyncRunner(name="pacing", local_root=str(tmp_path / "state")) as runner:
        handle = await runner.run(_app(f"until [ -e {go} ]; do sleep 0.01; done"), "local_cwd")
        assert not runner._exits_awaited()
        waiting = asyncio.create_task(runner.wait(handle))
        await asyncio.sleep(0)
        assert runner._exits_awaited()
        go.touch()
        await waiting
        assert not runner._exits_awaited()
        other = await runner.run(_app("sleep 30"), "local_cwd")
        async with contextlib.aclosing(runner.as_completed([handle, other])) as done:
            async for _ in done:
                assert runner._exits_awaited()
                break  # left early: the listener of the other app goes too
        assert not runner._exits_awaited()
        await runner.cancel(other)
        await runner.wait(other)
        assert not runner._exits_awaited()
