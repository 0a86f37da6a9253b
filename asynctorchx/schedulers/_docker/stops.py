"""Stopping containers without waiting out their stop timeout.

Docker's stop request answers once the container has stopped: after its SIGTERM handler, or the
SIGKILL its stop timeout ends in. The escalation is the engine's own and goes on if the client
that asked goes away, so a cancel need only know that each stop is under way in the engine, not
wait for it: ``stop_all`` sends the stops and tells (``under_way``) as soon as the engine has
reported each container signalled (its ``kill`` event on the scheduler's event feed) or the stop
has ended. A stop the engine refuses (it cannot be reached) ends with its error before that, so
a refusal is still seen by the caller. Without the event feed (disabled, or not connected in
time) a stop is known to be under way only once it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers._docker.events import EventFeed


async def stop_all(
    engine: DockerEngine,
    feed: EventFeed | None,
    tasks: TaskSupervisor,
    cids: Sequence[str],
    under_way: Callable[[], None],
) -> list[Exception | None]:
    """Stops ``cids`` at once (each with its own stop timeout) and returns once every stop has
    ended, with each one's error (None: stopped, or not running).

    ``under_way`` is called once every stop is under way in the engine (signalled, or ended) with
    none refused so far; with a refusal it is not called, and the caller raises as before, once
    every stop has ended. The stops run as tasks of ``tasks``.
    """
    if feed is not None and cids:
        await feed.connected()  # a fresh process: its kill events tell that the stops are under way
    watched = feed.kills(cids) if feed is not None else contextlib.nullcontext(None)
    with watched as kills:
        seen = {cid: (kills or {}).get(cid) or asyncio.Event() for cid in cids}

        async def stop(cid: str) -> Exception | None:
            try:
                await engine.stop_container(cid)
            except Exception as e:
                return e
            finally:
                seen[cid].set()
            return None

        if tasks.closed:  # closing: no task can be started, the caller waits for the stops
            results = list(await asyncio.gather(*(stop(cid) for cid in cids)))
            if not any(results):
                under_way()
            return results
        stops = [tasks.spawn(stop(cid), name=f"stop:{cid[:12]}") for cid in cids]
        for waiter in seen.values():
            await waiter.wait()
        if not any(s.done() and s.result() is not None for s in stops):
            under_way()
        return list(await asyncio.gather(*stops))
