"""What the embedding features cost: limits and launch events on the submit path, scoped launches.

    python benchmarks/bench_embed.py [--submits 5000] [--local 10]

Prints one JSON object:

- ``submit_us``: microseconds per ``run()`` on the scripted in-memory backend (no I/O, so the
  runner's own cost), in four modes: ``plain``; ``limits`` (``max_concurrent_submits=64``);
  ``events`` (a ``launch_events()`` listener); ``launched`` (``async with runner.launched(...)``
  with ``cancel_on_normal_exit=True``: submit, cancel and wait for CANCELLED). Submits run 100 at
  a time (``asyncio.gather``).
- ``local_cancel_ms``: on ``local_cwd``, from ``Task.cancel()`` of a task inside
  ``runner.launched(sh -c 'sleep 60')`` to the task's end (the app is CANCELLED by then):
  median and max over ``--local`` apps.
- ``close_followed_s``: seconds from ``close()`` until ``--followers`` ``as_completed``/``watch``
  iterations of one app (on the scripted backend) have all ended with "the runner was closed".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from asynctorchx import AsyncRunner
from asynctorchx.runner import Limits
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.testing import ScriptedBackend


def app(name: str = "bench") -> AppDef:
    return AppDef(name, [Role("main", image=".", entrypoint="sh", args=["-c", "sleep 60"])])


async def submits(mode: str, n: int) -> float:
    backend = ScriptedBackend("scripted")
    limits = {"scripted": Limits(max_concurrent_submits=64)} if mode == "limits" else None
    async with AsyncRunner(
        "bench", scheduler_factories={"scripted": backend}, limits=limits
    ) as runner:
        events = runner.launch_events() if mode == "events" else None

        async def one() -> None:
            if mode == "launched":
                async with runner.launched(app(), "scripted", cancel_on_normal_exit=True):
                    pass
            else:
                await runner.run(app(), "scripted")

        start = time.perf_counter()
        for _ in range(n // 100):
            await asyncio.gather(*(one() for _ in range(100)))
        elapsed = time.perf_counter() - start
        if events is not None:
            await events.aclose()
    if mode == "launched":
        assert all(a.state == AppState.CANCELLED for a in backend.apps.values())
    return elapsed / n * 1e6


async def local_cancel(n: int, root: str) -> dict[str, float]:
    latencies: list[float] = []
    async with AsyncRunner("bench-embed", local_root=root) as runner:

        async def block(inside: asyncio.Event, handles: list[str]) -> None:
            async with runner.launched(app(), "local_cwd") as handle:
                handles.append(handle)
                inside.set()
                await asyncio.Event().wait()

        for _ in range(n):
            inside = asyncio.Event()
            handles: list[str] = []
            task = asyncio.create_task(block(inside, handles))
            await inside.wait()
            start = time.perf_counter()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            latencies.append((time.perf_counter() - start) * 1e3)
            status = await runner.status(handles[0])
            assert status is not None and status.state == AppState.CANCELLED
    return {"median": statistics.median(latencies), "max": max(latencies), "count": n}


async def close_followed(n: int) -> float:
    runner = AsyncRunner("bench", scheduler_factories={"sb": ScriptedBackend("sb")})
    await runner.open()
    handle = await runner.run(app(), "sb")
    listening = asyncio.Event()
    started = 0

    async def follow(i: int) -> None:
        nonlocal started
        started += 1
        if started == n:
            listening.set()
        try:
            async for _ in runner.as_completed([handle]) if i % 2 else runner.watch([handle]):
                pass
        except RuntimeError:
            pass

    tasks = [asyncio.create_task(follow(i)) for i in range(n)]
    await listening.wait()
    for _ in range(10):  # each iteration subscribes at its first step
        await asyncio.sleep(0)
    t0 = time.perf_counter()
    await runner.close()
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"submits": args.submits}
    result["submit_us"] = {
        mode: round(await submits(mode, args.submits), 1)
        for mode in ("plain", "limits", "events", "launched")
    }
    root = tempfile.mkdtemp(prefix="bench-embed-")
    try:
        result["local_cancel_ms"] = await local_cancel(args.local, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["close_followed_s"] = {
        "followers": args.followers,
        "seconds": round(await close_followed(args.followers), 3),
    }
    result["cpus"] = os.cpu_count()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submits", type=int, default=5000)
    parser.add_argument("--local", type=int, default=10)
    parser.add_argument("--followers", type=int, default=20_000)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
