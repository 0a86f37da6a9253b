"""Who owes the stops of a cancelled ``local_docker`` app, and taking them over from a dead canceller.

A cancel marker names the process that made it (``LABEL_CANCELLER``: boot id, pid namespace, pid
and start time). That canceller stops the containers started before its marker, the launch (or
retry) those started after it; nobody else signals them, since a second SIGTERM runs an app's
handler again. A canceller killed between its marker and its stops would leave the app
"cancelling" for good: any process that sees the app so (its follow-up of the app, the next
``describe``, a second ``cancel``) and can tell, on the same host, that the canceller's process is
gone takes over by making the marker of the next turn (one process wins the name) and stopping
the containers the dead canceller owed.

A canceller may have died after asking the engine to stop them: the engine goes on with that stop
(SIGTERM, then SIGKILL after the container's stop timeout) whether or not its client lives. So the
process that finds the canceller gone first waits out that stop timeout (the canceller died
before it was found gone, so any stop it asked for ends by then) and stops only the containers
still running after it: a container is never signalled again while its handler runs.

A container started after the marker is its starter's to stop (the launch, or a retry, looks
for the marker after its starts); a starter killed before it could leaves it running, so the
same take-over stops the containers started after the marker whose starter is gone.

A canceller that lives but whose stops were cut off (the engine unreachable meanwhile) finishes
them once the engine answers again (``own_stops_owed``): the stop requests it sent may have
reached the engine, so it too waits out their stop timeout, counted from the failure, and stops
only the containers still running then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from asynctorchx.schedulers._docker.actions import started_after
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers._docker.processes import process_gone, process_identity
from asynctorchx.schedulers._docker.request import (
    DEFAULT_STOP_TIMEOUT,
    LABEL_CANCEL_TURN,
    LABEL_CANCELLER,
    LABEL_LAUNCHER,
    cancel_marker,
)
from asynctorchx.schedulers._docker.state import Assessment, ContainerInfo

#: how long past a container's stop timeout the engine may take to have killed it
STOP_SLACK = 2.0


def turn(marker: ContainerInfo) -> int:
    """The turn of a cancel marker (1 for the first one)."""
    try:
        return max(int(marker.labels.get(LABEL_CANCEL_TURN, "1")), 1)
    except ValueError:
        return 1


def abandoned_cancel(a: Assessment) -> ContainerInfo | None:
    """The newest cancel marker of app ``a`` when containers of the app still run and their
    stops may have nobody: the marker's maker has exited, or a live container's starter has (one
    it started after the marker was its own to stop). The cancel is then to be looked at by
    ``take_over_if_abandoned``; else None. Asks no engine."""
    markers = [c for c in a.containers if c.is_marker]
    alive = [c for c in a.containers if c.alive and not c.is_marker]
    if not markers or not alive:
        return None
    owner = max(markers, key=turn)
    if process_gone(owner.labels.get(LABEL_CANCELLER, "")) or any(_starter_gone(c) for c in alive):
        return owner
    return None


def _starter_gone(c: ContainerInfo) -> bool:
    """True when the process that started ``c`` (its launch, or the retry that made it) has
    exited (on this host: else it cannot be told)."""
    return process_gone(c.labels.get(LABEL_LAUNCHER, ""))


async def take_over_if_abandoned(
    engine: DockerEngine, a: Assessment, on_wait: Callable[[], None] | None = None
) -> bool:
    """Finishes the cancel of app ``a`` if its canceller died before stopping its containers.

    ``on_wait`` is called before waiting out the dead canceller's stop timeout (a cancel then
    returns, the take-over goes on).

    Returns True when this process took the cancel over (and has stopped what the dead owed:
    the containers started before the first marker, when the canceller has exited, and those
    started after it whose starter has exited, that still run once any stop either asked for has
    ended), False when there is nothing to do: no marker, nothing alive, the stops' owners still
    alive (or that cannot be judged), or another process that took over first.
    """
    owner = abandoned_cancel(a)
    if owner is None:
        return False
    canceller_gone = process_gone(owner.labels.get(LABEL_CANCELLER, ""))
    first = min((c for c in a.containers if c.is_marker), key=turn)
    alive = [c for c in a.containers if c.alive and not c.is_marker]
    later = await started_after(engine, first.id, [c.id for c in alive])
    owed = [
        c.id
        for c, after in zip(alive, later, strict=True)
        if (canceller_gone and after is not True) or (after is True and _starter_gone(c))
    ]
    if not owed:
        return False
    infos = await asyncio.gather(*(engine.inspect_container(c) for c in owed))
    if on_wait is not None:
        on_wait()
    await asyncio.sleep(max(_stop_timeout(info) for info in infos) + STOP_SLACK)
    infos = await asyncio.gather(*(engine.inspect_container(c) for c in owed))
    owed = [c for c, info in zip(owed, infos, strict=True) if _running(info)]
    if not owed:
        return False  # the canceller's stops had been asked for: the engine ended them
    marker = cancel_marker(
        a.response.app_id,
        a.name,
        a.session,
        owner.image,
        canceller=process_identity(),
        turn=turn(owner) + 1,
    )
    what = f"taking over the cancel of {a.response.app_id}"
    if await engine.create_container(marker.config, marker.name, what=what, exist_ok=True) is None:
        return False
    await asyncio.gather(*(engine.stop_container(c) for c in owed))
    return True


async def own_stops_owed(
    engine: DockerEngine,
    a: Assessment,
    marker: ContainerInfo,
    failed_at: float,
    on_wait: Callable[[], None] | None = None,
) -> list[str]:
    """The containers of app ``a`` that this process, the maker of its cancel ``marker``, still
    owes a stop after its stops failed at ``failed_at`` (``time.monotonic()``): those started
    before the marker that still run once any stop request that reached the engine has ended
    (their stop timeout after the failure; the wait is over at once after a long outage).
    ``on_wait`` is called before that wait, if there is one.
    """
    alive = [c.id for c in a.containers if c.alive and not c.is_record]
    later = await started_after(engine, marker.id, alive)
    owed = [c for c, after in zip(alive, later, strict=True) if after is not True]
    if not owed:
        return []
    infos = await asyncio.gather(*(engine.inspect_container(c) for c in owed))
    ends = failed_at + max(_stop_timeout(info) for info in infos) + STOP_SLACK
    if ends > time.monotonic():
        if on_wait is not None:
            on_wait()
        await asyncio.sleep(ends - time.monotonic())
        infos = await asyncio.gather(*(engine.inspect_container(c) for c in owed))
    return [c for c, info in zip(owed, infos, strict=True) if _running(info)]


def _stop_timeout(info: dict[str, Any] | None) -> float:
    """The seconds the engine gives a container between its stop signal and SIGKILL."""
    value = ((info or {}).get("Config") or {}).get("StopTimeout")
    return float(value) if isinstance(value, int) and value >= 0 else DEFAULT_STOP_TIMEOUT


def _running(info: dict[str, Any] | None) -> bool:
    """True when an ``inspect`` answer shows the container running (or about to restart)."""
    state = (info or {}).get("State") or {}
    return bool(state.get("Running") or state.get("Restarting"))
