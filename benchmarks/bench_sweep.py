"""A sweep driver's cost: many short apps through ``as_completed``, a bounded number running at once.

    python benchmarks/bench_sweep.py [--apps 1000] [--concurrency 100] [--sleep 0] [--floor]

The driver keeps at most ``--concurrency`` apps running (launched or being launched): it starts
launches in the background up to the limit, takes the next finished app from
``runner.as_completed(running)`` (oldest first when several have finished), which frees a slot for a
replacement, and so on until every app has finished. Each app runs ``sh -c "[sleep S;] date +%s.%N"`` on ``local_cwd``: its last line is the
moment it exits, read back from its log afterwards to measure the exit-to-wake latency (from that
line to the moment ``as_completed`` yielded the app).

Prints one JSON object: launches per second over the whole run, wake latency (median/p95/max, ms),
CPU of the driver process (``getrusage(RUSAGE_SELF)``, seconds and percent of one core over the run),
the event loop thread's CPU per app (``time.thread_time``: what bounds the launches per second
once the loop is saturated) and where the rest of its wall time per app went (``loop_off_cpu``,
from the thread's ``schedstat``: ready but waiting for a core, or blocked: in ``epoll``, in a
spawn waiting for the child's ``exec``, or waiting for the GIL),
total wall time, the most apps seen running at once, and the StatusHub's round count.

``--floor`` runs the same programs the same way with none of asynctorchx: bare asyncio spawning
each with ``os.posix_spawn`` (a new session, stdout and stderr on pipes), reading the pipes to EOF
and reaping the exit through a pidfd, at most ``--concurrency`` at once. No log files, no record,
no cgroup, no status: what any asyncio launcher pays on this machine. Prints launches per second,
the loop thread's CPU per app and the apps' own CPU per app.
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
from typing import Any

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role

LOCAL = "local_cwd"


def cpu() -> tuple[float, float]:
    """(user + system seconds of this process, of its reaped children)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def loop_sched() -> tuple[float, float, int, int]:
    """This thread's (seconds on a CPU, seconds ready but waiting for one, voluntary and involuntary
    context switches), from ``/proc``; zeros where that cannot be read."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = (int(x) for x in f.read().split())
        with open("/proc/thread-self/status") as f:
            switches = dict(line.split(":") for line in f if "ctxt_switches" in line)
    except (OSError, ValueError):
        return 0.0, 0.0, 0, 0
    return (
        on_cpu / 1e9,
        waiting / 1e9,
        int(switches["voluntary_ctxt_switches"]),
        int(switches["nonvoluntary_ctxt_switches"]),
    )


def off_cpu(
    before: tuple[float, float, int, int], after: tuple[float, float, int, int], wall: float, n: int
) -> dict[str, float]:
    """Per app: the loop thread's wall time off the CPU, split into ready and blocked."""
    on_cpu, waiting = after[0] - before[0], after[1] - before[1]
    return {
        "ready_ms_per_app": 1000 * waiting / n,
        "blocked_ms_per_app": 1000 * (wall - on_cpu - waiting) / n,
        "voluntary_switches_per_app": (after[2] - before[2]) / n,
        "involuntary_switches_per_app": (after[3] - before[3]) / n,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "median": statistics.median(v),
        "p95": v[min(len(v) - 1, int(len(v) * 0.95))],
        "max": v[-1],
        "count": len(v),
    }


async def sweep(apps: int, concurrency: int, sleep: float, root: str) -> dict[str, Any]:
    script = (f"sleep {sleep}; " if sleep > 0 else "") + "date +%s.%N"
    app = AppDef("sweep", [Role("main", image=".", entrypoint="sh", args=["-c", script])])
    woke: dict[str, float] = {}
    states: dict[str, str] = {}
    running: dict[str, None] = {}  # launch order, so the oldest finished app is taken first
    launched = launching = max_running = 0
    started = asyncio.Event()

    async with AsyncRunner(name=f"bench-sweep-{os.getpid()}", local_root=root) as runner:

        async def launch() -> None:
            nonlocal launching, max_running
            handle = await runner.run(app, LOCAL)
            launching -= 1
            running[handle] = None
            max_running = max(max_running, len(running))
            started.set()

        cpu0, kids0 = cpu()
        loop_cpu0 = time.thread_time()
        sched0 = loop_sched()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as launches:
            while launched < apps or running or launching:
                while launched < apps and len(running) + launching < concurrency:
                    launched += 1
                    launching += 1
                    launches.start_soon(launch)
                if not running:
                    started.clear()
                    await started.wait()
                    continue
                # the next app to finish among those launched so far; replacements are launched in
                # the background and join the next as_completed
                async with contextlib.aclosing(runner.as_completed(list(running))) as finished:
                    async for handle, status in finished:
                        woke[handle] = time.time()
                        states[handle] = status.state.name if status else AppState.UNKNOWN.name
                        del running[handle]
                        break
        wall = time.perf_counter() - t0
        loop_cpu = time.thread_time() - loop_cpu0
        sched1 = loop_sched()
        cpu1, kids1 = cpu()
        rounds = runner.hub(LOCAL).rounds

        latencies = []
        unreadable = 0
        for handle, wake in woke.items():
            lines = [ln async for ln in runner.log_lines(handle, "main")]
            try:
                latencies.append((wake - float(lines[-1])) * 1000)
            except (IndexError, ValueError):
                unreadable += 1

    counts: dict[str, int] = {}
    for state in states.values():
        counts[state] = counts.get(state, 0) + 1
    return {
        "apps": apps,
        "concurrency": concurrency,
        "app_sleep_s": sleep,
        "wall_s": wall,
        "launches_per_s": apps / wall,
        "wake_latency_ms": percentiles(latencies) if latencies else None,
        "unreadable_exit_lines": unreadable,
        "driver_cpu_s": cpu1 - cpu0,
        "driver_cpu_percent": 100 * (cpu1 - cpu0) / wall,
        "loop_cpu_ms_per_app": 1000 * loop_cpu / apps,
        "loop_off_cpu": off_cpu(sched0, sched1, wall, apps),
        "children_cpu_s": kids1 - kids0,
        "max_running": max_running,
        "status_rounds": rounds,
        "states": counts,
    }


async def floor(
    apps: int, concurrency: int, sleep: float, script: str | None = None
) -> dict[str, Any]:
    """The sweep's programs (or ``sh -c script``) spawned, read and reaped on bare asyncio."""
    loop = asyncio.get_running_loop()
    env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
    if script is None:
        script = (f"sleep {sleep}; " if sleep > 0 else "") + "date +%s.%N"
    argv = ["sh", "-c", script]
    sh = shutil.which("sh") or "/bin/sh"
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            actions = [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
            pid = os.posix_spawn(sh, argv, env, file_actions=actions, setsid=True)
            os.close(out_w)
            os.close(err_w)
            pidfd = os.pidfd_open(pid)
            done = loop.create_future()
            left = [out_r, err_r, pidfd]

            def ended(fd: int) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                left.remove(fd)
                if not left:
                    done.set_result(None)

            def readable(fd: int) -> None:
                if not os.read(fd, 1 << 16):
                    ended(fd)

            def exited() -> None:
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                ended(pidfd)

            loop.add_reader(out_r, readable, out_r)
            loop.add_reader(err_r, readable, err_r)
            loop.add_reader(pidfd, exited)
            await done

    _, kids0 = cpu()
    loop_cpu0 = time.thread_time()
    sched0 = loop_sched()
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(apps)))
    wall = time.perf_counter() - t0
    sched1 = loop_sched()
    _, kids1 = cpu()
    return {
        "floor": True,
        "apps": apps,
        "concurrency": concurrency,
        "app_sleep_s": sleep,
        "wall_s": wall,
        "launches_per_s": apps / wall,
        "loop_cpu_ms_per_app": 1000 * (time.thread_time() - loop_cpu0) / apps,
        "loop_off_cpu": off_cpu(sched0, sched1, wall, apps),
        "children_cpu_ms_per_app": 1000 * (kids1 - kids0) / apps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--apps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="seconds each app sleeps before it prints and exits",
    )
    parser.add_argument("--root", help="parent of the state root (default: the temp dir)")
    parser.add_argument(
        "--floor", action="store_true", help="the same apps on bare asyncio (no asynctorchx)"
    )
    args = parser.parse_args()
    if args.floor:
        result = asyncio.run(floor(args.apps, args.concurrency, args.sleep))
        result["python"] = sys.version.split()[0]
        result["cpus"] = os.cpu_count()
        print(json.dumps(result, indent=2))
        return 0
    root = tempfile.mkdtemp(prefix="bench-sweep-", dir=args.root)
    try:
        result = asyncio.run(sweep(args.apps, args.concurrency, args.sleep, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["state_root"] = os.path.dirname(root)
    result["python"] = sys.version.split()[0]
    result["cpus"] = os.cpu_count()
    print(json.dumps(result, indent=2))
    return 0 if result["states"] == {"SUCCEEDED": args.apps} else 1


if __name__ == "__main__":
    sys.exit(main())
