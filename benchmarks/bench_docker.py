"""local_docker benchmarks on the local Docker engine; prints one JSON object.

    bash scripts/engines/docker.sh        # engine + the local test images
    bash benchmarks/setup_torchx.sh       # optional: TorchX 0.7.0 in benchmarks/.venv-torchx
    python benchmarks/bench_docker.py [--rounds 3] [--apps 20] [--wake 15]

Scenarios, each for asynctorchx and (when its virtualenv exists) TorchX 0.7.0's ``local_docker``
on the same local busybox image:

- ``launch_finish``: seconds from submitting ``--apps`` one-container apps at once until every one
  is known to have finished (asynctorchx: ``run`` x N then ``wait_all``; TorchX: one thread per app
  doing ``run`` then ``wait(wait_interval=0.1)``, the quickest a TorchX user can wait).
- ``exit_to_wake``: milliseconds from a container's exit (Docker's ``State.FinishedAt``) until the
  waiter on its app returns, for ``--wake`` apps exiting at staggered times (asynctorchx: the
  runner woken through Docker's event stream; TorchX: polling at 0.1 s). Target: median <= 50 ms.
  For asynctorchx it is split into the engine's own part (exit -> its ``die`` event, seen by a
  separate subscription) and ours (``die`` event -> waiter woken).

Every container made here is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TORCHX_PY = HERE / ".venv-torchx" / "bin" / "python"
IMAGE = "asynctorchx-test/busybox:latest"
TARGET_WAKE_MS = 50.0


def _finished_at_ns(value: str) -> int:
    """Docker's RFC 3339 nanosecond time as epoch nanoseconds."""
    sys.path.insert(0, str(HERE.parent))
    from asynctorchx.logs._timestamps import parse_rfc3339_ns

    return parse_rfc3339_ns(value)


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}
    return {
        "median": round(statistics.median(v), 2),
        "p95": round(v[min(len(v) - 1, int(len(v) * 0.95))], 2),
        "min": round(v[0], 2),
        "max": round(v[-1], 2),
        "count": len(v),
    }


# -- asynctorchx ---------------------------------------------------------------------------------


async def _purge(label: str) -> None:
    import aiodocker

    async with aiodocker.Docker() as client:
        for c in await client.containers.list(all=True, filters=json.dumps({"label": [label]})):
            try:
                await c.delete(force=True)
            except aiodocker.DockerError:
                pass


async def atx_launch_finish(n: int) -> float:
    from asynctorchx.runner import AsyncRunner
    from asynctorchx.specs import AppDef, AppState, Role

    session = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    try:
        async with AsyncRunner(name=session) as runner:
            apps = [
                AppDef(f"bench-{i}", [Role("main", IMAGE, entrypoint="true")]) for i in range(n)
            ]
            start = time.perf_counter()
            handles = await asyncio.gather(*(runner.run(a, "local_docker") for a in apps))
            done = await runner.wait_all(handles, timeout=300)
            elapsed = time.perf_counter() - start
            states = {s.state if s else None for s in done.values()}
            if states != {AppState.SUCCEEDED}:
                raise RuntimeError(f"not every app succeeded: {states}")
            return elapsed
    finally:
        await _purge(f"asynctorchx.io/session={session}")


async def _die_events(client: Any, label: str, sink: dict[str, int]) -> None:
    """Records the engine's time of each ``die`` event (container name -> epoch ns)."""
    import aiohttp

    params = {"filters": json.dumps({"type": ["container"], "label": [label], "event": ["die"]})}
    async with client._query("events", params=params, timeout=aiohttp.ClientTimeout()) as resp:
        try:
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = json.loads(line)
                    sink[event["Actor"]["Attributes"]["name"]] = int(event["timeNano"])
        finally:
            resp.close()


async def atx_exit_to_wake(n: int) -> dict[str, list[float]]:
    """Per app: exit -> wake, exit -> Docker's die event, and die event -> wake (milliseconds)."""
    import aiodocker

    from asynctorchx.runner import AsyncRunner
    from asynctorchx.specs import AppDef, Role
    from asynctorchx.specs.api import parse_app_handle

    session = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    label = f"asynctorchx.io/session={session}"
    out: dict[str, list[float]] = {"exit_to_wake": [], "exit_to_event": [], "event_to_wake": []}
    try:
        async with AsyncRunner(name=session) as runner, aiodocker.Docker() as client:
            die_at: dict[str, int] = {}
            listener = asyncio.ensure_future(_die_events(client, label, die_at))
            await asyncio.sleep(0.2)  # let the benchmark's own event subscription connect
            apps = [
                AppDef(
                    f"wake-{i}",
                    [Role("main", IMAGE, entrypoint="sleep", args=[f"{1.0 + 0.25 * i:.2f}"])],
                )
                for i in range(n)
            ]
            handles = await asyncio.gather(*(runner.run(a, "local_docker") for a in apps))
            woke: dict[str, int] = {}

            async def waiter(handle: str) -> None:
                await runner.wait(handle, timeout=120)
                woke[handle] = time.time_ns()

            await asyncio.gather(*(waiter(h) for h in handles))
            listener.cancel()
            for h in handles:
                name = f"{parse_app_handle(h).app_id}-main-0"
                info = await client.containers.container(name).show()
                finished = _finished_at_ns(info["State"]["FinishedAt"])
                out["exit_to_wake"].append((woke[h] - finished) / 1e6)
                if name in die_at:
                    out["exit_to_event"].append((die_at[name] - finished) / 1e6)
                    out["event_to_wake"].append((woke[h] - die_at[name]) / 1e6)
    finally:
        await _purge(label)
    return out


# -- TorchX (in its own virtualenv, driven through a child process) ------------------------------

TORCHX_WORKER = r"""
import json, sys, threading, time, logging
logging.disable(logging.WARNING)
from torchx.runner import get_runner
from torchx.specs import AppDef, Role, AppState
import docker

scenario, n, image = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runner = get_runner("bench")
client = docker.from_env()
out = {}
handles = [None] * n
woke = [0] * n

def one(i, app):
    h = runner.run(app, "local_docker")
    handles[i] = h
    status = runner.wait(h, wait_interval=0.1)
    woke[i] = time.time_ns()
    if status is None or status.state != AppState.SUCCEEDED:
        raise SystemExit(f"app {h} ended {status}")

try:
    if scenario == "launch_finish":
        apps = [AppDef(f"bench-{i}", [Role("main", image, entrypoint="true")]) for i in range(n)]
    else:
        apps = [
            AppDef(f"wake-{i}", [Role("main", image, entrypoint="sleep", args=[f"{1.0 + 0.25 * i:.2f}"])])
            for i in range(n)
        ]
    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(apps)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = time.perf_counter() - start
    if scenario == "exit_to_wake":
        lat = []
        for i, h in enumerate(handles):
            app_id = h.rsplit("/", 1)[1]
            c = client.containers.list(all=True, filters={"label": f"torchx.pytorch.org/app-id={app_id}"})[0]
            out.setdefault("finished_at", []).append([c.attrs["State"]["FinishedAt"], woke[i]])
    print(json.dumps(out))
finally:
    for c in client.containers.list(all=True, filters={"label": "torchx.pytorch.org/app-id"}):
        if any(h and h.endswith(c.labels.get("torchx.pytorch.org/app-id", "?")) for h in handles):
            c.remove(force=True)
"""


def torchx_run(scenario: str, n: int) -> dict[str, Any]:
    if not TORCHX_PY.exists():
        return {"error": f"{TORCHX_PY} missing: run bash benchmarks/setup_torchx.sh"}
    proc = subprocess.run(
        [str(TORCHX_PY), "-c", TORCHX_WORKER, scenario, str(n), IMAGE],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def torchx_exit_to_wake(n: int) -> dict[str, Any]:
    result = torchx_run("exit_to_wake", n)
    if "error" in result:
        return result
    lat = [(woke - _finished_at_ns(fin)) / 1e6 for fin, woke in result["finished_at"]]
    return {"latencies": lat}


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apps", type=int, default=20)
    parser.add_argument("--wake", type=int, default=15)
    parser.add_argument("--no-torchx", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))

    result: dict[str, Any] = {
        "benchmark": "local_docker",
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "image": IMAGE,
        "rounds": args.rounds,
    }
    atx_launch: list[float] = []
    tx_launch: list[float] = []
    tx_errors: list[str] = []
    for r in range(args.rounds):
        order = ["atx", "torchx"] if r % 2 == 0 else ["torchx", "atx"]
        for impl in order:
            if impl == "atx":
                atx_launch.append(asyncio.run(atx_launch_finish(args.apps)))
            elif not args.no_torchx:
                res = torchx_run("launch_finish", args.apps)
                if "error" in res:
                    tx_errors.append(res["error"])
                else:
                    tx_launch.append(res["seconds"])
    wake = asyncio.run(atx_exit_to_wake(args.wake))
    result["asynctorchx"] = {
        f"launch_finish_{args.apps}_apps_s": _stats(atx_launch),
        "exit_to_wake_ms": _stats(wake["exit_to_wake"]),
        "breakdown": {
            "docker_exit_to_die_event_ms": _stats(wake["exit_to_event"]),
            "die_event_to_wake_ms": _stats(wake["event_to_wake"]),
        },
    }
    result["target_exit_to_wake_median_ms"] = TARGET_WAKE_MS
    result["meets_target"] = statistics.median(wake["exit_to_wake"]) <= TARGET_WAKE_MS
    if args.no_torchx:
        result["torchx"] = {"skipped": "--no-torchx"}
    else:
        tx: dict[str, Any] = {"version": "0.7.0", "scheduler": "local_docker"}
        if tx_launch:
            tx[f"launch_finish_{args.apps}_apps_s"] = _stats(tx_launch)
        wake = torchx_exit_to_wake(args.wake)
        if "error" in wake:
            tx_errors.append(wake["error"])
        else:
            tx["exit_to_wake_ms"] = _stats(wake["latencies"])
        if tx_errors:
            tx["errors"] = sorted(set(tx_errors))
        result["torchx"] = tx
        a = result["asynctorchx"]
        ratio: dict[str, float] = {}
        key = f"launch_finish_{args.apps}_apps_s"
        if key in tx and a[key]:
            ratio[key] = round(tx[key]["median"] / a[key]["median"], 2)
        if "exit_to_wake_ms" in tx and a["exit_to_wake_ms"]["median"] > 0:
            ratio["exit_to_wake_ms"] = round(
                tx["exit_to_wake_ms"]["median"] / a["exit_to_wake_ms"]["median"], 2
            )
        result["torchx_over_asynctorchx"] = ratio
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
