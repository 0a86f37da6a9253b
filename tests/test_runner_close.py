"""What a runner's close() ends: the log iterations it handed out (a tail of an app the close does
not stop would go on reading), scheduler closes that hang or fail; and wait(timeout=0) under a call
rate (one look)."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    docker_engine,
    docker_session,
    purge_session,
)
from _fake_scheduler import ClosingFakeScheduler, TailingFakeScheduler

from asynctorchx import AsyncRunner
from asynctorchx.runner import PollSettings
from asynctorchx.specs import AppDef, Role

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


@pytest.mark.parametrize("value", [0, -1, math.nan, "5", True, None])
def test_a_bad_close_timeout_is_refused_naming_it(value: Any) -> None:
    """close_timeout must be a number of seconds > 0: anything else is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"^close_timeout must be a number of seconds > 0"):
        AsyncRunner("t", close_timeout=value)
