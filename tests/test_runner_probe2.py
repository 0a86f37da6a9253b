"""Faults found by probing the runner's close against everything else: waiters of one backend held
by another's hung status round or by a log iteration slow to close, a log reader whose source's
close hangs, launch blocks left while the runner closes, calls whose backend answered as it closed."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
from _fake_scheduler import DeafFakeScheduler, FakeScheduler

from asynctorchx import AsyncRunner
from asynctorchx.runner import PollSettings
from asynctorchx.specs import AppDef, Role

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
