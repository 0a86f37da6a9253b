"""Benchmarks of the local backend (``local_cwd``); prints one JSON object.

    python benchmarks/bench_local.py                  # everything, state root in the temp dir
    python benchmarks/bench_local.py --root /dev/shm  # state root (records and logs) on tmpfs
    python benchmarks/bench_local.py --only fanout,wake --rounds 3

Scenarios (targets from issue 3, on a 2-core machine):

- ``spawn_floor``: the machine's own floor for ``fanout``: 200 bare ``posix_spawn`` calls of
  ``sh -c "exit 0"`` with their pipes, then reaping them, with no log files, records or event loop.

- ``fanout``: 200 apps of ``sh -c "exit 0"`` submitted at once through ``AsyncRunner.run`` and waited
  with ``wait_all``; seconds until all are terminal (target <= 0.25 s). ``fanout_scheduler`` is the same
  directly on the scheduler (submit + pushed changes), without the runner. ``fanout`` and
  ``spawn_floor`` also report the CPU seconds of a round, the launcher's and its children's: on two
  cores a round cannot take less than half their sum (``two_core_floor_s``).
- ``wake``: exit-to-wake latency: each app runs ``sleep D; exec date +%s.%N`` and the time printed just
  before its exit is compared with when ``runner.as_completed`` yields it (target median <= 5 ms).
- ``idle_cpu``: CPU time of this process (user + system, children excluded) while 100 apps sleep 20 s
  and are waited on, over the window where they all sleep (target <= 0.5 % of a core).
- ``launch_busy``: one app's ``run()`` on a runner already running 100 apps (``sleep``), 200 times
  one after the other: milliseconds from the call until it returns with the app RUNNING (target
  median <= 3 ms, p99 <= 20 ms: a service launching on request, issue 17).
- ``concurrent``: 1000 apps running at the same time in one event loop (each blocks on a lock this
  process holds until all are submitted), each waited on with ``runner.wait``.
- ``mass_exit``: one app of N replicas (500, 1000, 2000) that all block on a lock this process holds,
  then exit together when it is released; reports the longest event-loop stall from the release
  until the app is terminal (target <= 50 ms at 2000, issue 12): ``stall_ms`` is the CPU time of the
  loop's longest iteration (its own work), ``stall_wall_ms`` how late a 1 ms timer chain ran (this
  includes the time the OS did not run this process while N processes exit on two cores), and
  ``idle_floor_*`` the same two with N bare processes exiting and an idle loop (the machine's
  floor). ``start_stall_*``: the same for the start of the app (its replicas start in one
  synchronous burst, so this one grows with N).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import platform
import random
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
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role, is_terminal

TARGETS = {
    "fanout.seconds.median": ("<=", 0.25),
    "wake.latency_ms.median": ("<=", 5.0),
    "idle_cpu.cpu_percent": ("<=", 0.5),
    "launch_busy.run_to_running_ms.median": ("<=", 3.0),
    "launch_busy.run_to_running_ms.p99": ("<=", 20.0),
    "concurrent.succeeded": ("==", 1000),
    "concurrent.running_at_once": ("==", 1000),
    "mass_exit.2000.stall_ms": ("<=", 50.0),
}


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_split() -> tuple[float, float]:
    """CPU seconds used so far (user + system) by this process and by its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


class CpuRounds:
    """CPU per round of a scenario: the launcher's and its children's. Two cores give at most 2 CPU
    seconds per second, so ``(launcher + children) / 2`` bounds a round's time from below."""

    def __init__(self) -> None:
        self.launcher: list[float] = []
        self.children: list[float] = []
        self._start = (0.0, 0.0)

    def begin(self) -> None:
        self._start = cpu_split()

    def end(self) -> None:
        own, kids = cpu_split()
        self.launcher.append(own - self._start[0])
        self.children.append(kids - self._start[1])

    def summary(self) -> dict[str, float]:
        launcher = statistics.median(self.launcher)
        children = statistics.median(self.children)
        return {
            "launcher_median": launcher,
            "children_median": children,
            "two_core_floor_s": (launcher + children) / 2,
        }


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "median": statistics.median(v),
        "min": v[0],
        "p95": v[min(len(v) - 1, int(len(v) * 0.95))],
        "max": v[-1],
        "count": len(v),
    }


def sh_app(name: str, script: str) -> AppDef:
    return AppDef(name, [Role("main", image=".", entrypoint="sh", args=["-c", script])])


def filesystem_of(path: Path) -> str:
    best, fs = "", "?"
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount, kind = parts[1], parts[2]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                best
            ):
                best, fs = mount, kind
    return fs


async def fanout(root: Path, n: int, rounds: int) -> dict[str, Any]:
    times, ok = [], []
    cpu = CpuRounds()
    app = sh_app("fan", "exit 0")
    async with AsyncRunner(name="bench-fanout", local_root=str(root)) as runner:
        await runner.wait(await runner.run(app, "local_cwd"))  # warm-up (watchdog, imports)
        for _ in range(rounds):
            cpu.begin()
            t0 = time.perf_counter()
            handles = await asyncio.gather(*(runner.run(app, "local_cwd") for _ in range(n)))
            done = await runner.wait_all(handles)
            times.append(time.perf_counter() - t0)
            cpu.end()
            ok.append(
                sum(1 for s in done.values() if s is not None and s.state == AppState.SUCCEEDED)
            )
            await asyncio.sleep(0.3)
    return {
        "n": n,
        "seconds": stats(times),
        "rounds": times,
        "succeeded": ok,
        "cpu_seconds": cpu.summary(),
    }


async def fanout_scheduler(root: Path, n: int, rounds: int) -> dict[str, Any]:
    times = []
    app = sh_app("fan", "exit 0")
    async with LocalScheduler("bench-fanout-sched", local_root=root) as s:
        await s.submit(app, {})
        for _ in range(rounds):
            pending: set[str] = set()
            all_done = asyncio.Event()

            def on_change(
                app_id: str, pending: set[str] = pending, all_done: asyncio.Event = all_done
            ) -> None:
                state = s._runtime.state_of(app_id)
                if state is not None and is_terminal(state):
                    pending.discard(app_id)
                    if not pending:
                        all_done.set()

            unsubscribe = s.subscribe(on_change)
            t0 = time.perf_counter()
            infos = [s.submit_dryrun(app, {}) for _ in range(n)]
            pending.update(i.request.app_id for i in infos)
            await asyncio.gather(*(s.schedule(i) for i in infos))
            if pending:
                await all_done.wait()
            times.append(time.perf_counter() - t0)
            unsubscribe()
            await asyncio.sleep(0.3)
    return {"n": n, "seconds": stats(times), "rounds": times}


async def spawn_floor(n: int, rounds: int) -> dict[str, Any]:
    """What the machine itself costs: ``n`` bare ``posix_spawn`` of ``sh -c "exit 0"`` (own session,
    stdout and stderr on pipes, as a replica starts) and their reaping, without any bookkeeping."""
    times = []
    cpu = CpuRounds()
    env = dict(os.environ)
    for _ in range(rounds):
        cpu.begin()
        t0 = time.perf_counter()
        pids = []
        for _ in range(n):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            pids.append(
                os.posix_spawn(
                    "/bin/sh",
                    ["sh", "-c", "exit 0"],
                    env,
                    file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)],
                    setsid=True,
                )
            )
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
        for pid in pids:
            os.waitpid(pid, 0)
        times.append(time.perf_counter() - t0)
        cpu.end()
        await asyncio.sleep(0.3)
    return {"n": n, "seconds": stats(times), "rounds": times, "cpu_seconds": cpu.summary()}


async def wake(root: Path, n: int) -> dict[str, Any]:
    rng = random.Random(7)
    async with AsyncRunner(name="bench-wake", local_root=str(root)) as runner:
        handles = []
        for _ in range(n):
            delay = f"{rng.uniform(0.3, 1.5):.3f}"
            handles.append(
                await runner.run(sh_app("wake", f"sleep {delay}; exec date +%s.%N"), "local_cwd")
            )
        woke: dict[str, float] = {}
        async for handle, _ in runner.as_completed(handles):
            woke[handle] = time.time()
        latencies = []
        for h in handles:
            lines = [line async for line in runner.log_lines(h, "main")]
            latencies.append((woke[h] - float(lines[-1])) * 1000)
    return {"n": n, "latency_ms": stats(latencies)}


async def launch_busy(root: Path, busy: int, n: int) -> dict[str, Any]:
    """One app's ``run()`` on a runner already running ``busy`` apps, ``n`` times one after the
    other: milliseconds from the call until it returns with the app RUNNING (a service's request
    latency; issue 17 target 3)."""
    sleeper = sh_app("busy", "exec sleep 120")
    one = sh_app("one", "exec sleep 120")
    latencies, states = [], []
    async with AsyncRunner(name="bench-launch-busy", local_root=str(root)) as runner:
        background = [await runner.run(sleeper, "local_cwd") for _ in range(busy)]
        running = sum(
            1
            for st in await asyncio.gather(*(runner.status(h) for h in background))
            if st is not None and st.state == AppState.RUNNING
        )
        await asyncio.sleep(0.5)
        launched = []
        for _ in range(n):
            t0 = time.perf_counter()
            handle = await runner.run(one, "local_cwd")
            latencies.append((time.perf_counter() - t0) * 1000)
            status = await runner.status(handle)
            states.append(status.state.name if status is not None else "NONE")
            launched.append(handle)
            await asyncio.sleep(0.02)
        await asyncio.gather(*(runner.cancel(h) for h in background + launched))
        await runner.wait_all(background + launched)
    lat = sorted(latencies)
    return {
        "busy_apps_running": running,
        "n": n,
        "run_to_running_ms": {
            **stats(latencies),
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        },
        "states_after_run": {s: states.count(s) for s in set(states)},
    }


async def idle_cpu(root: Path, n: int, seconds: float) -> dict[str, Any]:
    async with AsyncRunner(name="bench-idle", local_root=str(root)) as runner:
        app = AppDef("idle", [Role("main", image=".", entrypoint="sleep", args=[str(seconds)])])
        t_start = time.perf_counter()
        handles = [await runner.run(app, "local_cwd") for _ in range(n)]
        waiters = asyncio.gather(*(runner.wait(h) for h in handles))
        await asyncio.sleep(0.5)
        c0, t0 = cpu_seconds(), time.perf_counter()
        window = max(1.0, seconds - (t0 - t_start) - 1.0)
        await asyncio.sleep(window)
        cpu = cpu_seconds() - c0
        wall = time.perf_counter() - t0
        statuses = await waiters
    return {
        "n": n,
        "window_s": wall,
        "cpu_s": cpu,
        "cpu_percent": 100 * cpu / wall,
        "succeeded": sum(1 for st in statuses if st is not None and st.state == AppState.SUCCEEDED),
    }


async def concurrent(root: Path, n: int) -> dict[str, Any]:
    # every app blocks (no CPU) on a shared lock this process holds until all n are running
    lock_path = root / "gate.lock"
    gate = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        async with AsyncRunner(name="bench-concurrent", local_root=str(root)) as runner:
            app = AppDef(
                "many",
                [Role("main", image=".", entrypoint="flock", args=["-s", str(lock_path), "true"])],
            )
            t0 = time.perf_counter()
            handles = await asyncio.gather(*(runner.run(app, "local_cwd") for _ in range(n)))
            submitted = time.perf_counter() - t0
            waiters = asyncio.gather(*(runner.wait(h) for h in handles))
            statuses = await asyncio.gather(*(runner.status(h) for h in handles))
            running = sum(1 for st in statuses if st is not None and st.state == AppState.RUNNING)
            fds = len(os.listdir("/proc/self/fd"))
            threads = len(os.listdir("/proc/self/task"))
            t1 = time.perf_counter()
            fcntl.flock(gate, fcntl.LOCK_UN)
            done = await waiters
            released_to_done = time.perf_counter() - t1
            total = time.perf_counter() - t0
    finally:
        os.close(gate)
    return {
        "n": n,
        "submit_s": submitted,
        "running_at_once": running,
        "open_fds_at_peak": fds,
        "threads_at_peak": threads,
        "release_to_all_terminal_s": released_to_done,
        "all_terminal_s": total,
        "succeeded": sum(1 for st in done if st is not None and st.state == AppState.SUCCEEDED),
    }


class StallMeter:
    """How long the event loop went without running its callbacks, two ways.

    ``wall``: a timer due every millisecond notes how late it fires (this includes the time the OS
    did not schedule this process at all). ``cpu``: the CPU time of this thread in each loop
    iteration (the work the loop did before it could wait again, without the time it was preempted).
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.worst = 0.0
        self.worst_cpu = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.worst = 0.0
        self.worst_cpu = 0.0
        loop = self._loop = asyncio.get_running_loop()
        self._arm(loop, loop.time())
        inner = type(loop)._run_once  # type: ignore[attr-defined]

        def run_once() -> None:
            t = time.thread_time()
            inner(loop)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - t)

        loop._run_once = run_once  # type: ignore[attr-defined]

    def _arm(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        due = now + self.period
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        self.worst = max(self.worst, now - due)
        self._arm(loop, now)

    def stop(self) -> tuple[float, float]:
        """Stops measuring; returns the longest stalls in ms: ``(wall, cpu)``."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._loop is not None:
            with contextlib.suppress(AttributeError):
                del self._loop._run_once  # type: ignore[attr-defined]
            self._loop = None
        return self.worst * 1000, self.worst_cpu * 1000


async def idle_stall(root: Path, n: int) -> tuple[float, float]:
    """The machine's floor: the same stalls while ``n`` bare processes blocked on a lock exit
    together and the loop has nothing to do with them (no scheduler)."""
    lock_path = root / f"floor-{n}.lock"
    gate = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(gate, fcntl.LOCK_EX)
    pids = []
    try:
        for _ in range(n):
            pids.append(
                os.posix_spawn(
                    "/usr/bin/flock", ["flock", "-s", str(lock_path), "true"], dict(os.environ)
                )
            )
        await asyncio.sleep(1.0)
        meter = StallMeter()
        meter.start()
        await release(gate)
        await asyncio.sleep(1.5)
        return meter.stop()
    finally:
        os.close(gate)
        for pid in pids:
            os.waitpid(pid, 0)


async def release(gate: int) -> None:
    """Unlocks ``gate`` from a worker thread (waking thousands of waiters takes the kernel ~0.1 s)."""
    await asyncio.get_running_loop().run_in_executor(None, fcntl.flock, gate, fcntl.LOCK_UN)


async def mass_exit(root: Path, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        lock_path = root / f"mass-{n}.lock"
        gate = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(gate, fcntl.LOCK_EX)
        meter = StallMeter()
        try:
            async with LocalScheduler("bench-mass", local_root=root) as s:
                role = Role(
                    "main",
                    image=".",
                    entrypoint="flock",
                    args=["-s", str(lock_path), "true"],
                    num_replicas=n,
                )
                info = s.submit_dryrun(AppDef("mass", [role]), {})
                app_id = info.request.app_id
                done = asyncio.Event()

                def on_change(
                    a: str, s: LocalScheduler = s, app_id: str = app_id, done: asyncio.Event = done
                ) -> None:
                    # O(1): a describe per notification would add its own O(N) to what is measured
                    state = s._runtime.state_of(a)
                    if a == app_id and (state is None or is_terminal(state)):
                        done.set()

                unsubscribe = s.subscribe(on_change)
                meter.start()
                t0 = time.perf_counter()
                await s.schedule(info)
                submit_s = time.perf_counter() - t0
                start_stall, start_cpu = meter.stop()
                with anyio.fail_after(300):
                    while True:
                        desc = await s.describe(app_id)
                        assert desc is not None
                        reps = desc.roles_statuses[0].replicas
                        if all(r.state == AppState.RUNNING for r in reps):
                            break
                        await asyncio.sleep(0.2)
                await asyncio.sleep(0.5)  # let the record writes of the start settle
                meter.start()
                t1 = time.perf_counter()
                await release(gate)
                await asyncio.wait_for(done.wait(), 300)
                terminal_s = time.perf_counter() - t1
                stall, stall_cpu = meter.stop()
                unsubscribe()
                desc = await s.describe(app_id)
                out[str(n)] = {
                    "stall_ms": stall_cpu,
                    "stall_wall_ms": stall,
                    "release_to_terminal_s": terminal_s,
                    "state": desc.state.name if desc else None,
                    "submit_s": submit_s,
                    "start_stall_ms": start_cpu,
                    "start_stall_wall_ms": start_stall,
                }
        finally:
            meter.stop()
            os.close(gate)
        floor_wall, floor_cpu = await idle_stall(root, n)
        out[str(n)]["idle_floor_wall_ms"] = floor_wall
        out[str(n)]["idle_floor_cpu_ms"] = floor_cpu
    return out


def dig(results: dict[str, Any], path: str) -> Any:
    value: Any = results
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", help="parent of the state root (default: the temp dir)")
    parser.add_argument("--only", help="comma-separated scenarios")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()
    parent = Path(args.root) if args.root else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="atx-bench-local-", dir=parent))
    wanted = set(args.only.split(",")) if args.only else None
    q = args.quick
    plan = {
        "spawn_floor": lambda: spawn_floor(200, 2 if q else args.rounds),
        "fanout": lambda: fanout(root, 200, 2 if q else args.rounds),
        "fanout_scheduler": lambda: fanout_scheduler(root, 200, 2 if q else args.rounds),
        "wake": lambda: wake(root, 10 if q else 30),
        "idle_cpu": lambda: idle_cpu(root, 20 if q else 100, 5 if q else 20),
        "launch_busy": lambda: launch_busy(root, 20 if q else 100, 20 if q else 200),
        "concurrent": lambda: concurrent(root, 100 if q else 1000),
        "mass_exit": lambda: mass_exit(root, [100, 200] if q else [500, 1000, 2000]),
    }
    results: dict[str, Any] = {}
    try:
        for name, run in plan.items():
            if wanted is None or name in wanted:
                results[name] = await run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    met = {}
    for path, (op, bound) in TARGETS.items():
        value = dig(results, path)
        if value is not None:
            met[path] = {
                "value": value,
                "target": f"{op} {bound}",
                "met": value <= bound if op == "<=" else value == bound,
            }
    out = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "loadavg_at_end": os.getloadavg(),
        },
        "state_root_fs": filesystem_of(root.parent),
        "results": results,
        "targets": met,
    }
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    asyncio.run(main())
