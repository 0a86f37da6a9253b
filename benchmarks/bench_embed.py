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
    result["cpus"] = os.cpu_count()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submits", type=int, default=5000)
    parser.add_argument("--local", type=int, default=10)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
