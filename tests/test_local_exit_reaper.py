"""The exit reaper (``spawn.ExitReaper``): a few exits per event-loop iteration are reaped inline,
the rest in batches in a worker thread; an exit that comes while the thread reaps a batch is still
reaped inline when its iteration has room, rather than waiting behind the batch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._local import spawn
from asynctorchx.schedulers._local.spawn import ExitReaper

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def supervisor() -> AsyncIterator[TaskSupervisor]:
    sup = TaskSupervisor("test-reaper")
    yield sup
    await sup.aclose()


@pytest.fixture
def held_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The worker thread's reaping waits inside ``reap_batch`` until released: (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def held(jobs: list[tuple[int, int, str | None]]) -> list[tuple[int | None, bool]]:
        entered.set()
        release.wait(20)
        return [(0, False) for _ in jobs]

    monkeypatch.setattr(spawn, "reap_batch", held)
    yield entered, release
    release.set()


def replica(n: int) -> Any:
    return SimpleNamespace(pid=1000 + n, pidfd=-1, cgroup=None, name=f"r{n}")


async def test_exits_beyond_the_inline_share_of_an_iteration_go_to_the_thread(
    supervisor: TaskSupervisor,
) -> None:
    reaper = ExitReaper(supervisor, lambda *a: None)
    verdicts = [reaper.busy() for _ in range(ExitReaper.INLINE + 3)]
    assert verdicts == [False] * ExitReaper.INLINE + [True] * 3
    await asyncio.sleep(0)  # the next iteration has its own share
    assert reaper.busy() is False


async def test_an_exit_while_the_thread_reaps_a_batch_is_reaped_inline(
    supervisor: TaskSupervisor, held_thread: tuple[threading.Event, threading.Event]
) -> None:
    """Queued behind a batch, an exit would wait for the thread, whose turns at the GIL a busy
    event loop hands over once per switch interval for each system call of the reaping (24 ms
    from exit to reaped, median, in a sweep). With room in its iteration it is reaped at once."""
    entered, release = held_thread
    reaped: list[str] = []
    reaper = ExitReaper(supervisor, lambda app, rep, code, left: reaped.append(rep.name))
    reaper.add(SimpleNamespace(), replica(0))
    assert await asyncio.to_thread(entered.wait, 10)  # the thread is in the batch
    await asyncio.sleep(0)
    assert reaper.busy() is False  # room in this iteration: reaped inline, not queued
    release.set()
    await reaper.idle()
    assert reaped == ["r0"]


async def test_exits_queued_for_a_reaper_cancelled_before_it_ran_are_reaped(
    supervisor: TaskSupervisor,
) -> None:
    """The scheduler closing in the iteration that started the worker (cancelled before its first
    step): the exits queued for it are reaped all the same, none is left reaping forever, and a
    later exit (closing) is reaped at once."""
    reaped: list[str] = []
    reaper = ExitReaper(supervisor, lambda app, rep, *a: reaped.append(rep.name))
    reaper.add(None, replica(1))  # type: ignore[arg-type]
    reaper.add(None, replica(2))  # type: ignore[arg-type]
    await supervisor.aclose()
    await asyncio.sleep(0)  # (the task's end is handed over in the next iteration)
    assert reaped == ["r1", "r2"]
    await reaper.idle()
    reaper.add(None, replica(3))  # type: ignore[arg-type]
    assert reaped == ["r1", "r2", "r3"]


async def test_a_batch_in_the_thread_when_the_reaper_is_cancelled_is_handed_over(
    supervisor: TaskSupervisor, held_thread: tuple[threading.Event, threading.Event]
) -> None:
    """Closing while the thread reaps a batch: the close waits for the thread and hands over
    what it reaped (a replica reaped by the thread but never handed over would stay reaping)."""
    entered, release = held_thread
    reaped: list[str] = []
    reaper = ExitReaper(supervisor, lambda app, rep, *a: reaped.append(rep.name))
    reaper.add(None, replica(1))  # type: ignore[arg-type]
    await asyncio.to_thread(entered.wait, 10)
    closing = asyncio.create_task(supervisor.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # (it waits for the thread)
    release.set()
    await closing
    assert reaped == ["r1"]


def test_a_pidfd_that_cannot_be_waited_on_loses_its_exit_code_not_the_batch() -> None:
    """``reap_batch`` with a closed pidfd in the middle: that one is lost (-255), the others are
    reaped."""
    import os
    import subprocess

    procs = [subprocess.Popen(["true"]) for _ in range(2)]
    fds = [os.pidfd_open(p.pid) for p in procs]
    for p in procs:
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    closed_r, closed_w = os.pipe()
    os.close(closed_r)
    os.close(closed_w)
    try:
        jobs = [
            (procs[0].pid, fds[0], None),
            (99999999, closed_r, None),
            (procs[1].pid, fds[1], None),
        ]
        assert spawn.reap_batch(jobs) == [(0, False), (-255, False), (0, False)]
    finally:
        for fd in fds:
            os.close(fd)
        for p in procs:
            p.returncode = 0


async def test_waiting_for_idle_lets_a_reaper_that_just_ended_hand_its_queue_over(
    supervisor: TaskSupervisor,
) -> None:
    """A caller polling a replica's ``reaping`` around ``idle()`` while the reaper's task has
    just been cancelled (its queue is handed over in a callback): it sees the replica reaped
    instead of spinning without yielding."""
    reaped: list[str] = []
    rep = replica(1)
    rep.reaping = True

    def on_reaped(app: Any, r: Any, *args: Any) -> None:
        r.reaping = False
        reaped.append(r.name)

    reaper = ExitReaper(supervisor, on_reaped)
    reaper.add(None, rep)  # type: ignore[arg-type]
    task = reaper._task
    assert task is not None
    task.cancel()  # (cancelled before its first step; its queue is handed over when it ends)
    await asyncio.sleep(0)
    assert task.done() and reaped == []  # ended; the hand-over is queued for the next iteration
    with anyio.fail_after(5):
        while rep.reaping:
            await reaper.idle()
    assert reaped == ["r1"]
