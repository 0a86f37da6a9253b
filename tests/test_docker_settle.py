"""local_docker's event feed settling the exits of containers Docker may restart (REPLICA retries).

Found by the suite running on two workers: a REPLICA-retried app whose second run failed stayed
RUNNING for 30 s. Its second exit came while the first one's settle (an inspect, which waits for the
engine's lock on the container) was still under way, and was dropped: the listing that followed
could show the container running, and no further event came to say otherwise. These tests drive the
feed with scripted events and a scripted engine (the real engine cannot be made to interleave the
two exits and the inspect on demand); ``test_docker_engine.py`` runs the same retries on Docker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._docker.events import EventFeed
from asynctorchx.schedulers._docker.request import (
    LABEL_APP_ID,
    LABEL_MAX_RETRIES,
    LABEL_RETRY_POLICY,
)

APP = "app-1"
CID = "c" * 64
LABELS = {LABEL_APP_ID: APP, LABEL_RETRY_POLICY: "REPLICA", LABEL_MAX_RETRIES: "1"}


class Engine:
    """Inspects that wait until the test lets each one return; listings of one container."""

    def __init__(self) -> None:
        self.inspects: asyncio.Queue[asyncio.Event] = asyncio.Queue()
        self.state = "running"

    async def inspect_container(self, cid: str) -> dict[str, Any]:
        answer = asyncio.Event()
        await self.inspects.put(answer)
        await answer.wait()
        return {"Id": cid}

    async def list_containers(self, label: str) -> list[dict[str, Any]]:
        status = "Exited (5) 1 second ago" if self.state == "exited" else "Up 1 second"
        return [
            {"Id": CID, "Names": ["/w-0"], "Labels": LABELS, "State": self.state, "Status": status}
        ]


def event(action: str, **attrs: str) -> dict[str, Any]:
    return {"Action": action, "id": CID, "Actor": {"ID": CID, "Attributes": {**LABELS, **attrs}}}


class Changes:
    """The apps the feed reported changed, and an event set at each report."""

    def __init__(self) -> None:
        self.apps: list[str] = []
        self.reported = asyncio.Event()

    def __call__(self, app_id: str) -> None:
        self.apps.append(app_id)
        self.reported.set()

    async def next(self) -> None:
        self.reported.clear()
        await asyncio.wait_for(self.reported.wait(), 5)


@pytest.fixture
async def feed() -> AsyncIterator[tuple[EventFeed, Engine, Changes]]:
    engine = Engine()
    tasks = TaskSupervisor("test")
    changes = Changes()
    feed = EventFeed(
        engine,  # type: ignore[arg-type]
        tasks,
        on_change=changes,
        on_follow_up=lambda _: None,
        enabled=False,
    )
    yield feed, engine, changes
    await tasks.aclose()


@pytest.mark.timeout(10)
async def test_an_exit_during_the_last_exits_settle_is_settled_too(
    feed: tuple[EventFeed, Engine, Changes],
) -> None:
    """Two exits of one container, the second while the first's inspect is under way: a second
    inspect follows, and the change is reported once both have returned (it was dropped)."""
    feed_, engine, changes = feed
    feed_.handle(event("die", exitCode="5"))
    first = await engine.inspects.get()
    feed_.handle(event("start"))
    feed_.handle(event("die", exitCode="5"))
    assert changes.apps == [APP]  # the start's
    first.set()
    second = await asyncio.wait_for(engine.inspects.get(), 5)
    assert changes.apps == [APP]  # not yet the settle's: the second exit is not settled
    second.set()
    await changes.next()
    assert changes.apps == [APP, APP] and engine.inspects.empty()


@pytest.mark.timeout(10)
async def test_a_listing_taken_while_an_exit_settles_is_not_reused_after_it(
    feed: tuple[EventFeed, Engine, Changes],
) -> None:
    """A listing made between a restartable exit and the end of its settle may show the container
    as it was before the exit: once settled, the next status lists again (the stale listing was
    kept as the app's snapshot, RUNNING for up to 30 s)."""
    feed_, engine, changes = feed
    feed_._ready = asyncio.Event()  # a connected stream, without following a real one
    feed_._ready.set()
    feed_.handle(event("die", exitCode="5"))
    inspect = await engine.inspects.get()
    [listed] = await feed_.containers(APP)  # the engine's listing lags the exit
    assert listed.state == "running" and feed_.snapshot([APP]) is not None
    engine.state = "exited"
    inspect.set()
    await changes.next()
    assert feed_.snapshot([APP]) is None
    [now] = await feed_.app_containers(APP)
    assert (now.state, now.exit_code) == ("exited", 5)
