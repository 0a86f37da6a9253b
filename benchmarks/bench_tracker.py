"""A sweep driver following the metadata of many running trials through the file tracker.

    python benchmarks/bench_tracker.py [--trials 200] [--writes 3] [--active 10] [--idle 10]
                                       [--no-inotify]

``--trials`` real ``local_cwd`` apps (Python processes) are launched with the driver's run id as
``parent_run_id`` and a local fsspec tracker configured through ``.torchxconfig``. The driver follows
them all with one ``AsyncTrackerReader.watch_metadata(parent_run_id=...)``. Each trial calls
``app_run_from_env()`` and then, at ``--writes`` random moments of an active phase of ``--active``
seconds, ``add_metadata(step=i, t=time.time())``; then all trials sleep through an idle phase of
``--idle`` seconds and exit.

Prints one JSON object:

- ``latency_ms``: from the moment a trial called ``add_metadata`` (the ``t`` it recorded) to the
  moment the driver received that entry (median, p95, p99, max) and the share within 50 ms;
- ``missed``: entries written but never received (must be 0);
- ``idle_cpu_percent``: the driver process's CPU (``getrusage(RUSAGE_SELF)``: the runner watching
  200 apps plus the reader watching 200 runs) over the idle phase, in percent of one core;
- ``watcher``: ``inotify`` or ``scan`` (``--no-inotify``, i.e. ``ASYNCTORCHX_DISABLE_INOTIFY=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.tracker import AsyncTrackerReader

ROOT = Path(__file__).resolve().parent.parent

TRIAL = """
import random, sys, time
from asynctorchx.tracker import app_run_from_env
start, active, idle, writes = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
run = app_run_from_env()
moments = sorted(random.uniform(0, active) for _ in range(writes))
for i, m in enumerate(moments):
    time.sleep(max(0.0, start + m - time.time()))
    run.add_metadata(step=i, t=time.time())
time.sleep(max(0.0, start + active + idle - time.time()))
"""


def cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}

    def pick(q: float) -> float:
        return round(v[min(len(v) - 1, int(len(v) * q))], 2)

    return {
        "median": round(statistics.median(v), 2),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "max": round(v[-1], 2),
        "count": len(v),
    }


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs = work / "runs"
    runs.mkdir()
    (work / "tracker.conf").write_text(f"protocol=file\nroot_path={runs}\n")
    (work / ".torchxconfig").write_text(
        f"[torchx:tracker]\nfsspec =\n\n[tracker:fsspec]\nconfig = {work / 'tracker.conf'}\n"
    )
    os.environ["TORCHXCONFIG"] = str(work / ".torchxconfig")
    os.environ["ASYNCTORCHX_LOCAL_ROOT"] = str(work / "state")
    os.environ["PYTHONPATH"] = str(ROOT)
    driver = f"bench-driver-{os.getpid()}"
    latencies: list[float] = []
    received = 0
    expected = args.trials * args.writes
    idle_cpu: dict[str, float] = {}

    async with AsyncRunner("bench-tracker") as runner:
        reader = AsyncTrackerReader.from_root(runs)
        all_in = anyio.Event()

        async def follow() -> None:
            nonlocal received
            async with contextlib.aclosing(reader.watch_metadata(parent_run_id=driver)) as it:
                async for update in it:
                    now = time.time()
                    t = update.entry.get("t")
                    if isinstance(t, float):
                        latencies.append((now - t) * 1000)
                        received += 1
                        if received == expected:
                            all_in.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            # the trials start their active phase together, once all are launched
            launch_budget = 5.0 + args.trials * 0.1
            start = time.time() + launch_budget
            t0 = time.monotonic()
            app = AppDef(
                "trial",
                [
                    Role(
                        "trainer",
                        image=".",
                        entrypoint=sys.executable,
                        args=[
                            "-c",
                            TRIAL,
                            str(start),
                            str(args.active),
                            str(args.idle),
                            str(args.writes),
                        ],
                    )
                ],
            )
            handles = await asyncio.gather(
                *(runner.run(app, "local_cwd", parent_run_id=driver) for _ in range(args.trials))
            )
            launched_s = time.monotonic() - t0
            if time.time() > start:
                raise SystemExit(f"launching took {launched_s:.1f}s, past the start of the trials")
            # idle window: after the last write, before the trials exit (a margin either side)
            await anyio.sleep(max(0.0, start + args.active + 1.0 - time.time()))
            with anyio.move_on_after(1.0):
                await all_in.wait()
            window = start + args.active + args.idle - 1.0 - time.time()
            if window < 1.0:
                raise SystemExit("no idle window left: raise --idle")
            cpu0, w0 = cpu_seconds(), time.monotonic()
            await anyio.sleep(window)
            cpu1, w1 = cpu_seconds(), time.monotonic()
            idle_cpu = {
                "seconds": round(cpu1 - cpu0, 4),
                "window_s": round(w1 - w0, 2),
                "percent": round(100 * (cpu1 - cpu0) / (w1 - w0), 3),
            }
            done = await runner.wait_all(handles, timeout=60 + args.trials)
            tg.cancel_scope.cancel()
    states = [s.state.name if s else "UNKNOWN" for s in done.values()]
    return {
        "trials": args.trials,
        "writes_per_trial": args.writes,
        "watcher": "scan" if args.no_inotify else "inotify",
        "launch_s": round(launched_s, 2),
        "expected": expected,
        "received": received,
        "missed": expected - received,
        "latency_ms": stats(latencies),
        "within_50ms": round(sum(x <= 50 for x in latencies) / max(1, len(latencies)), 4),
        "idle_cpu_percent": idle_cpu["percent"],
        "idle_cpu": idle_cpu,
        "succeeded": sum(s == AppState.SUCCEEDED.name for s in states),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--writes", type=int, default=3, help="add_metadata calls per trial")
    parser.add_argument("--active", type=float, default=10.0, help="seconds of the writing phase")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle phase")
    parser.add_argument("--no-inotify", action="store_true", help="make the reader scan instead")
    args = parser.parse_args()
    if args.idle < 4:
        parser.error("--idle must be at least 4 seconds (a 1 s margin either side of the window)")
    if args.no_inotify:
        os.environ["ASYNCTORCHX_DISABLE_INOTIFY"] = "1"
    work = Path(tempfile.mkdtemp(prefix="bench-tracker-"))
    try:
        result = asyncio.run(bench(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
