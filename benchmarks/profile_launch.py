"""Where a local fan-out's launch time goes; prints JSON.

    python benchmarks/profile_launch.py run 200             # one fan-out, timed
    python benchmarks/profile_launch.py run 200 --cprofile  # + the event loop's time by kind
    python benchmarks/profile_launch.py syscalls 200        # system calls per app (needs strace)
    python benchmarks/profile_launch.py spawnwait 300       # how long one spawn blocks its caller
    python benchmarks/profile_launch.py readers 300         # a loop reader against an epoll set's
    python benchmarks/profile_launch.py floor 200           # the fan-out's floor on bare asyncio

The fan-out is compare_torchx's (``_compare_worker.py fanout``): a fresh interpreter, a fresh state
root under the temp dir (``--root`` for another parent), one warm-up app, then N apps of
``sh -c 'exit 0'`` launched with ``asyncio.gather(runner.run(...))`` and waited with ``wait_all``.

``syscalls`` runs the fan-out under ``strace -ff`` twice, with N and N/4 apps, and reports the
difference divided by the difference in apps: the system calls one more app costs the launching
process (all its threads; the apps' own processes, the watchdog and the start-up are left out).
The state root is removed after strace has finished, so its removal is not counted.

``spawnwait`` times N spawns the way the launcher makes them (``os.posix_spawn`` of ``sh -c 'exit
0'`` in a new session, its output on a pipe) while 0, 1 and 2 CPU-bound processes run, and while 2
processes start short programs one after the other (the churn of a sweep's replicas): the wall time
the calling thread is blocked (``posix_spawn`` returns once the child has exec'd, and holds the GIL
until then) against its CPU time. The difference is the child waiting for a core.

``readers`` times what watching a descriptor costs the event loop's thread (CPU): adding and
removing an asyncio reader (``loop.add_reader``/``remove_reader``, what a replica's two pipes and
pidfd cost today) against registering and unregistering it in an epoll set of one's own (one
``epoll_ctl`` each, plus the callback kept in a dict), over N pipes ten times.

``floor`` is the fan-out with none of asynctorchx: the same N programs spawned at once the way
``bench_sweep.py --floor`` spawns them (``os.posix_spawn`` in a new session, both pipes read to EOF,
the exit reaped through a pidfd; no record, cgroup, log file or status), after one warm-up spawn, in
a fresh interpreter like the fan-out's. It is the machine's own time for what the fan-out asks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

#: cProfile's names of the built-ins that matter on the launch path, and what to call them.
KINDS = {
    "<built-in method posix.posix_spawn>": "posix_spawn (holds the GIL until the child has exec'd)",
    "<method 'poll' of 'select.epoll' objects>": "epoll wait (the loop idle)",
    "<built-in method posix.open>": "open/mkdir on the loop",
    "<built-in method posix.mkdir>": "open/mkdir on the loop",
    "<built-in method posix.pipe>": "pipes, pidfds, close, read, stat",
    "<built-in method posix.pidfd_open>": "pipes, pidfds, close, read, stat",
    "<built-in method posix.close>": "pipes, pidfds, close, read, stat",
    "<built-in method posix.read>": "pipes, pidfds, close, read, stat",
    "<built-in method posix.stat>": "pipes, pidfds, close, read, stat",
    "<built-in method posix.access>": "pipes, pidfds, close, read, stat",
}
WRITERS = {"write_file": "cgroup.procs moves (write)", "_write_through": "watchdog pipe (write)"}


def by_kind(stats: Any) -> dict[str, float]:
    """The profiled thread's own time grouped by kind (everything not named: Python)."""
    out: collections.Counter[str] = collections.Counter()
    for (_, _, name), (_, _, tottime, _, callers) in stats.stats.items():
        if name == "<built-in method posix.write>":
            for (_, _, caller), timing in callers.items():
                out[WRITERS.get(caller, "log and index writes")] += timing[2]
        else:
            out[KINDS.get(name, "Python (runner, dry run, launch bookkeeping, asyncio)")] += tottime
    return {k: round(v, 4) for k, v in out.most_common()}


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds so far, (busy, idle), summed over its cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, idle / hz


async def fanout(n: int, workdir: str, profile: bool) -> dict[str, Any]:
    from asynctorchx import AsyncRunner, specs

    app = specs.AppDef(
        name="fan",
        roles=[specs.Role(name="main", image=workdir, entrypoint="sh", args=["-c", "exit 0"])],
    )
    async with AsyncRunner(name="bench") as runner:
        await runner.wait(await runner.run(app, "local_cwd"))
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        m0, c0, l0, t0 = machine_cpu(), os.times(), time.thread_time(), time.perf_counter()
        handles = await asyncio.gather(*(runner.run(app, "local_cwd") for _ in range(n)))
        launched = time.perf_counter() - t0
        done = await runner.wait_all(handles)
        elapsed, l1, c1, m1 = (
            time.perf_counter() - t0,
            time.thread_time(),
            os.times(),
            machine_cpu(),
        )
        per_app_ms = 1000 / n
        result: dict[str, Any] = {
            "n": n,
            "seconds": elapsed,
            "all_launched_s": launched,
            "launcher_cpu_user_s": c1.user - c0.user,
            "launcher_cpu_sys_s": c1.system - c0.system,
            # per app: the loop thread's CPU, the apps' (reaped children), and the whole machine's
            # CPU time busy and idle over the fan-out (both cores: busy + idle = 2 x wall)
            "loop_thread_cpu_ms_per_app": (l1 - l0) * per_app_ms,
            "children_cpu_ms_per_app": (
                c1.children_user + c1.children_system - c0.children_user - c0.children_system
            )
            * per_app_ms,
            "machine_busy_ms_per_app": (m1[0] - m0[0]) * per_app_ms,
            "machine_idle_ms_per_app": (m1[1] - m0[1]) * per_app_ms,
            "succeeded": sum(
                1 for s in done.values() if s is not None and s.state == specs.AppState.SUCCEEDED
            ),
        }
        if profiler is not None:
            import pstats

            profiler.disable()
            result["loop_thread_profile_s"] = by_kind(pstats.Stats(profiler))
        return result


def run(n: int, parent: str | None, profile: bool, keep: bool) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="atx-profile-launch-", dir=parent)
    os.environ["ASYNCTORCHX_LOCAL_ROOT"] = os.path.join(workdir, "state")
    os.chdir(workdir)
    try:
        result = asyncio.run(fanout(n, workdir, profile))
    finally:
        os.chdir("/")
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    result["workdir"] = workdir
    return result


def traced_counts(n: int, parent: str | None) -> dict[str, int]:
    """System calls of the launching process (all threads) in one fan-out of ``n`` under strace."""
    with tempfile.TemporaryDirectory(prefix="atx-strace-") as traces:
        cmd = [sys.executable, __file__, "run", str(n), "--keep"]
        if parent:
            cmd += ["--root", parent]
        proc = subprocess.run(
            ["strace", "-ff", "-o", os.path.join(traces, "t"), *cmd],
            capture_output=True,
            text=True,
            check=True,
        )
        shutil.rmtree(json.loads(proc.stdout)["workdir"], ignore_errors=True)
        counts: collections.Counter[str] = collections.Counter()
        for name in os.listdir(traces):
            with open(os.path.join(traces, name), errors="replace") as f:
                lines = f.read().splitlines()
            execs = [i for i, line in enumerate(lines) if line.startswith("execve(")]
            if execs and execs[0] != 0:
                continue  # forked, then exec'd: an app, the watchdog or a helper
            counts.update(m.group(1) for line in lines if (m := re.match(r"(\w+)\(", line)))
        return dict(counts)


def syscalls(n: int, parent: str | None) -> dict[str, Any]:
    small = max(1, n // 4)
    big_counts, small_counts = traced_counts(n, parent), traced_counts(small, parent)
    per_app = {
        k: round((big_counts.get(k, 0) - small_counts.get(k, 0)) / (n - small), 2)
        for k in set(big_counts) | set(small_counts)
    }
    per_app = dict(
        sorted(((k, v) for k, v in per_app.items() if abs(v) >= 0.3), key=lambda kv: -kv[1])
    )
    return {"n": [small, n], "per_app_total": round(sum(per_app.values()), 1), "per_app": per_app}


#: Background loads for ``spawnwait``: name -> (count, shell loop).
LOADS = {
    "idle": (0, ""),
    "1 busy": (1, "while :; do :; done"),
    "2 busy": (2, "while :; do :; done"),
    "2 churning": (2, "while :; do /bin/true; done"),
}


def spawn_wait(n: int) -> dict[str, Any]:
    """Per background load: the median, p90 and mean wall time of one spawn, and its median CPU
    time."""
    env = {k.encode(): v.encode() for k, v in os.environ.items()}
    out: dict[str, Any] = {}
    for name, (count, loop) in LOADS.items():
        load = [subprocess.Popen(["sh", "-c", loop]) for _ in range(count)]
        try:
            time.sleep(0.2 if load else 0)  # the load running
            wall, cpu = [], []
            for _ in range(n):
                r, w = os.pipe()
                t, c = time.perf_counter(), time.thread_time()
                pid = os.posix_spawn(
                    "/bin/sh",
                    ["sh", "-c", "exit 0"],
                    env,
                    file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)],
                    setsid=True,
                )
                wall.append(time.perf_counter() - t)
                cpu.append(time.thread_time() - c)
                os.close(w)
                os.close(r)
                os.waitpid(pid, 0)
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
        wall.sort()
        out[name] = {
            "wall_ms_median": round(1000 * wall[n // 2], 3),
            "wall_ms_p90": round(1000 * wall[n * 9 // 10], 3),
            "wall_ms_mean": round(1000 * sum(wall) / n, 3),
            "cpu_ms_median": round(1000 * sorted(cpu)[n // 2], 3),
        }
    return {"spawns": n, "cpus": os.cpu_count(), "spawn_wait": out}


async def readers(n: int) -> dict[str, Any]:
    import select

    loop = asyncio.get_running_loop()
    pipes = [os.pipe() for _ in range(n)]
    try:
        rounds = 10

        def callback(fd: int, stream: int) -> None:
            pass

        t = time.thread_time()
        for _ in range(rounds):
            for r, _ in pipes:
                loop.add_reader(r, callback, r, 1)
            for r, _ in pipes:
                loop.remove_reader(r)
        asyncio_us = (time.thread_time() - t) / (rounds * n) * 1e6
        epoll = select.epoll()
        callbacks: dict[int, tuple[Any, ...]] = {}
        t = time.thread_time()
        for _ in range(rounds):
            for r, _ in pipes:
                epoll.register(r, select.EPOLLIN)
                callbacks[r] = (callback, r, 1)
            for r, _ in pipes:
                del callbacks[r]
                epoll.unregister(r)
        own_us = (time.thread_time() - t) / (rounds * n) * 1e6
        epoll.close()
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    return {
        "descriptors": n,
        "add_and_remove_reader_us": round(asyncio_us, 2),
        "epoll_register_and_unregister_us": round(own_us, 2),
    }


def floor(n: int) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_sweep import floor as bare

    asyncio.run(bare(1, 1, 0.0, script="exit 0"))  # the warm-up, as in the fan-out
    result = asyncio.run(bare(n, n, 0.0, script="exit 0"))
    return {"n": n, "seconds": result["wall_s"], **result}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["run", "syscalls", "spawnwait", "readers", "floor"])
    parser.add_argument("n", type=int)
    parser.add_argument("--root", help="parent of the state root (default: the temp dir)")
    parser.add_argument("--cprofile", action="store_true", help="profile the event loop's thread")
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n < 2:
        parser.error(f"n must be at least 2, not {args.n}")
    if args.mode == "run":
        print(json.dumps(run(args.n, args.root, args.cprofile, args.keep)))
    elif args.mode == "readers":
        print(json.dumps(asyncio.run(readers(args.n))))
    elif args.mode == "floor":
        print(json.dumps(floor(args.n)))
    elif args.mode == "spawnwait":
        print(json.dumps(spawn_wait(args.n)))
    else:
        print(json.dumps(syscalls(args.n, args.root)))


if __name__ == "__main__":
    main()
