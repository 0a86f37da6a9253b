"""Helpers for the runner's tests."""

from __future__ import annotations

import anyio
import pytest

from asynctorchx import AsyncRunner


async def times_out_in_time(
    runner: AsyncRunner,
    handle: str,
    call: str,
    timeout: float,
    guard: float,
) -> bool:
    """Runs ``runner.wait`` (``call="wait"``) or ``wait_all`` with ``timeout``, which must raise
    TimeoutError; returns False when it was still waiting after ``guard`` seconds."""
    with anyio.move_on_after(guard) as scope, pytest.raises(TimeoutError):
        if call == "wait":
            await runner.wait(handle, timeout=timeout)
        else:
            await runner.wait_all([handle], timeout=timeout)
    return not scope.cancelled_caught
