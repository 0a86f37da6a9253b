"""One measurement of one scenario on one implementation; prints one JSON object.

Run by ``compare_torchx.py`` (never imported by it), so each measurement gets a fresh interpreter and
TorchX can live in its own virtual environment:

    python benchmarks/_compare_worker.py {asynctorchx|torchx} SCENARIO '{"n": 200}'
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

IMPL, SCENARIO, PARAMS = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
PY = sys.executable
WORKDIR = tempfile.mkdtemp(prefix=f"cmp-{IMPL}-")


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def find_marked(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if marker in cmd and ") Z" not in stat:
            pids.append(int(entry))
    return pids


def percentiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}
    return {
        "median": v[len(v) // 2],
        "p95": v[min(len(v) - 1, int(len(v) * 0.95))],
        "max": v[-1],
        "count": len(v),
    }


# -- apps (the same for both implementations) --------------------------------------------------


def role_kwargs(entrypoint: str, args: list[str]) -> dict[str, Any]:
    return {"name": "main", "image": os.getcwd(), "entrypoint": entrypoint, "args": args}


def scenario_app(specs: Any, name: str, entrypoint: str, args: list[str]) -> Any:
    return specs.AppDef(name=name, roles=[specs.Role(**role_kwargs(entrypoint, args))])


TAIL_SCRIPT = (
    "import random,sys,time\n"
    "n=int(sys.argv[1]); random.seed(1)\n"
    "for i in range(n):\n"
    "    time.sleep(random.uniform(0.05, 0.15))\n"
    "    sys.stdout.write(f'ts={time.time():.6f} i={i}\\n'); sys.stdout.flush()\n"
)
LINES_SCRIPT = (
    "import sys,time\nn=int(sys.argv[1])\nw=sys.stdout.write\n"
    "for i in range(n): w(f'line {i:07d} ' + 'x'*40 + '\\n')\n"
    "w(f'end {time.time():.6f}\\n')\n"
)
LINE_LEN = len("line 0000000 ") + 40


def read_result(seconds: float, cpu: float, lines: list[str], n: int) -> dict[str, Any]:
    """What a read scenario reports: time, reader CPU, and whether every line arrived whole."""
    body = [ln.rstrip("\n") for ln in lines if ln.strip()]
    intact = sum(1 for ln in body if ln.startswith("line ") and len(ln) == LINE_LEN)
    result: dict[str, Any] = {
        "seconds": seconds,
        "cpu_s": cpu,
        "lines": len(body),
        "intact_lines": intact,
        "expected_lines": n + 1,
    }
    if body and body[-1].startswith("end "):
        result["app_end_ts"] = float(body[-1].split()[1])
    return result


# -- asynctorchx -------------------------------------------------------------------------------


async def ours() -> dict[str, Any]:
    from asynctorchx import AsyncRunner, specs

    sched = "local_cwd"
    async with AsyncRunner(name="bench") as runner:
        if SCENARIO == "fanout":
            n = PARAMS["n"]
            app = scenario_app(specs, "fan", "sh", ["-c", "exit 0"])
            await runner.wait(
                await runner.run(app, sched)
            )  # warm-up; cold_start measures the first
            t0 = time.perf_counter()
            handles = await asyncio.gather(*(runner.run(app, sched) for _ in range(n)))
            done = await runner.wait_all(handles)
            elapsed = time.perf_counter() - t0
            ok = sum(1 for s in done.values() if s and s.state == specs.AppState.SUCCEEDED)
            return {"seconds": elapsed, "succeeded": ok}

        if SCENARIO == "wake":
            n = PARAMS["n"]
            rng = random.Random(7)
            handles = []
            for _ in range(n):
                delay = f"{rng.uniform(0.2, 0.8):.3f}"
                app = scenario_app(specs, "wake", "sh", ["-c", f"sleep {delay}; date +%s.%N"])
                handles.append(await runner.run(app, sched))
            woke: dict[str, float] = {}
            async for h, _ in runner.as_completed(handles):
                woke[h] = time.time()
            lat = []
            for h in handles:
                lines = [ln async for ln in runner.log_lines(h, "main")]
                lat.append((woke[h] - float(lines[-1])) * 1000)
            return {"latency_ms": percentiles(lat)}

        if SCENARIO == "idle_cpu":
            n, secs = PARAMS["n"], PARAMS["seconds"]
            app = scenario_app(specs, "idle", "sleep", [str(secs)])
            handles = [await runner.run(app, sched) for _ in range(n)]
            await asyncio.sleep(0.5)
            c0, t0 = cpu_seconds(), time.perf_counter()
            await runner.wait_all(handles)
            wall = time.perf_counter() - t0
            return {"cpu_percent": 100 * (cpu_seconds() - c0) / wall, "wall": wall}

        if SCENARIO == "tail":
            app = scenario_app(specs, "tail", PY, ["-u", "-c", TAIL_SCRIPT, str(PARAMS["lines"])])
            h = await runner.run(app, sched)
            lat = []
            async for line in runner.log_lines(h, "main", should_tail=True):
                now = time.time()
                m = re.match(r"ts=([0-9.]+)", line)
                if m:
                    lat.append((now - float(m.group(1))) * 1000)
            return {"latency_ms": percentiles(lat)}

        if SCENARIO in ("read_finished", "read_tailing"):
            n = PARAMS["lines"]
            app = scenario_app(specs, "lines", PY, ["-c", LINES_SCRIPT, str(n)])
            h = await runner.run(app, sched)
            if SCENARIO == "read_finished":
                await runner.wait(h)
            c0, t0 = cpu_seconds(), time.perf_counter()
            tail = SCENARIO == "read_tailing"
            got = [ln async for ln in runner.log_lines(h, "main", should_tail=tail)]
            t1, c1, end = time.perf_counter(), cpu_seconds(), time.time()
            result = read_result(t1 - t0, c1 - c0, got, n)
            app_end = result.pop("app_end_ts", None)
            if tail and app_end is not None:
                result["after_app_end_ms"] = (end - app_end) * 1000
            return result

        if SCENARIO == "cancel":
            marker = str(random.randint(100000, 999999))
            app = scenario_app(
                specs, "stubborn", "sh", ["-c", f"trap '' TERM; sleep {marker} & sleep {marker}"]
            )
            h = await runner.run(app, sched)
            while len(find_marked(marker)) < 2:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            await runner.cancel(h)
            returned = time.perf_counter() - t0
            st = await runner.wait(h, timeout=60)
            terminal = time.perf_counter() - t0
            await asyncio.sleep(PARAMS.get("settle", 1.0))
            survivors = find_marked(marker)
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)
            return {
                "cancel_returned_s": returned,
                "terminal_s": terminal,
                "state": st.state.name if st else None,
                "survivors": len(survivors),
            }
    raise SystemExit(f"unknown scenario {SCENARIO}")


# -- TorchX (driven the best way a TorchX user can) -------------------------------------------


def theirs() -> dict[str, Any]:
    from torchx import specs
    from torchx.runner import get_runner

    sched = "local_cwd"
    n = PARAMS.get("n", 1)
    runner = get_runner("bench", cache_size=max(200, 2 * n))
    try:
        if SCENARIO == "fanout":
            app = scenario_app(specs, "fan", "sh", ["-c", "exit 0"])
            runner.wait(
                runner.run(app, sched, cfg=torchx_cfg()), wait_interval=0.1
            )  # warm-up, as for asynctorchx
            t0 = time.perf_counter()
            handles = [runner.run(app, sched, cfg=torchx_cfg()) for _ in range(n)]
            with ThreadPoolExecutor(max_workers=n) as pool:
                states = list(pool.map(lambda h: runner.wait(h, wait_interval=0.1), handles))
            elapsed = time.perf_counter() - t0
            ok = sum(1 for s in states if s and s.state == specs.AppState.SUCCEEDED)
            return {"seconds": elapsed, "succeeded": ok}

        if SCENARIO == "wake":
            rng = random.Random(7)
            handles = []
            for _ in range(n):
                delay = f"{rng.uniform(0.2, 0.8):.3f}"
                app = scenario_app(specs, "wake", "sh", ["-c", f"sleep {delay}; date +%s.%N"])
                handles.append(runner.run(app, sched, cfg=torchx_cfg()))

            def wait_one(h: str) -> float:
                runner.wait(h, wait_interval=0.1)
                return time.time()

            with ThreadPoolExecutor(max_workers=n) as pool:
                woke = list(pool.map(wait_one, handles))
            lat = []
            for h, w in zip(handles, woke, strict=True):
                lines = [ln for ln in runner.log_lines(h, "main") if ln.strip()]
                lat.append((w - float(lines[-1])) * 1000)
            return {"latency_ms": percentiles(lat)}

        if SCENARIO == "idle_cpu":
            secs = PARAMS["seconds"]
            app = scenario_app(specs, "idle", "sleep", [str(secs)])
            handles = [runner.run(app, sched, cfg=torchx_cfg()) for _ in range(n)]
            time.sleep(0.5)
            c0, t0 = cpu_seconds(), time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(lambda h: runner.wait(h, wait_interval=0.1), handles))
            wall = time.perf_counter() - t0
            return {"cpu_percent": 100 * (cpu_seconds() - c0) / wall, "wall": wall}

        if SCENARIO == "tail":
            app = scenario_app(specs, "tail", PY, ["-u", "-c", TAIL_SCRIPT, str(PARAMS["lines"])])
            h = runner.run(app, sched, cfg=torchx_cfg())
            lat = []
            for line in runner.log_lines(h, "main", should_tail=True):
                now = time.time()
                m = re.match(r"ts=([0-9.]+)", line)
                if m:
                    lat.append((now - float(m.group(1))) * 1000)
            return {"latency_ms": percentiles(lat)}

        if SCENARIO in ("read_finished", "read_tailing"):
            lines_n = PARAMS["lines"]
            app = scenario_app(specs, "lines", PY, ["-c", LINES_SCRIPT, str(lines_n)])
            h = runner.run(app, sched, cfg=torchx_cfg())
            if SCENARIO == "read_finished":
                runner.wait(h, wait_interval=0.1)
            c0, t0 = cpu_seconds(), time.perf_counter()
            tail = SCENARIO == "read_tailing"
            got = list(runner.log_lines(h, "main", should_tail=tail))
            t1, c1, end = time.perf_counter(), cpu_seconds(), time.time()
            result = read_result(t1 - t0, c1 - c0, got, lines_n)
            app_end = result.pop("app_end_ts", None)
            if tail and app_end is not None:
                result["after_app_end_ms"] = (end - app_end) * 1000
            return result

        if SCENARIO == "cancel":
            marker = str(random.randint(100000, 999999))
            app = scenario_app(
                specs, "stubborn", "sh", ["-c", f"trap '' TERM; sleep {marker} & sleep {marker}"]
            )
            h = runner.run(app, sched, cfg=torchx_cfg())
            while len(find_marked(marker)) < 2:
                time.sleep(0.01)
            t0 = time.perf_counter()
            runner.cancel(h)
            returned = time.perf_counter() - t0
            st = runner.wait(h, wait_interval=0.1)
            terminal = time.perf_counter() - t0
            time.sleep(PARAMS.get("settle", 1.0))
            survivors = find_marked(marker)
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)
            return {
                "cancel_returned_s": returned,
                "terminal_s": terminal,
                "state": st.state.name if st else None,
                "survivors": len(survivors),
            }
    finally:
        runner.close()
    raise SystemExit(f"unknown scenario {SCENARIO}")


# -- cold start: import, runner, first app terminal (both measured from before the import) -------


def ours_cold() -> dict[str, Any]:
    t0 = time.perf_counter()
    from asynctorchx import AsyncRunner, specs

    async def first_app() -> tuple[float, str | None]:
        async with AsyncRunner(name="bench") as runner:
            app = scenario_app(specs, "cold", "sh", ["-c", "exit 0"])
            st = await runner.wait(await runner.run(app, "local_cwd", cfg=torchx_cfg()))
            return time.perf_counter(), st.state.name if st else None

    t1, state = asyncio.run(first_app())
    return {"seconds": t1 - t0, "with_close_s": time.perf_counter() - t0, "state": state}


def theirs_cold() -> dict[str, Any]:
    t0 = time.perf_counter()
    from torchx import specs
    from torchx.runner import get_runner

    runner = get_runner("bench")
    try:
        app = scenario_app(specs, "cold", "sh", ["-c", "exit 0"])
        st = runner.wait(runner.run(app, "local_cwd", cfg=torchx_cfg()), wait_interval=0.1)
        t1 = time.perf_counter()
    finally:
        runner.close()
    return {
        "seconds": t1 - t0,
        "with_close_s": time.perf_counter() - t0,
        "state": st.state.name if st else None,
    }


def torchx_cfg() -> dict[str, str]:
    """TorchX's logs go under the worker's own directory, like asynctorchx's state root."""
    return {"log_dir": os.path.join(WORKDIR, "logs")}


def main() -> None:
    os.chdir(WORKDIR)
    # a fresh state root per measurement: no records of earlier runs, nothing left in /tmp afterwards
    os.environ["ASYNCTORCHX_LOCAL_ROOT"] = os.path.join(WORKDIR, "state")
    try:
        if SCENARIO == "cold_start":
            result = ours_cold() if IMPL == "asynctorchx" else theirs_cold()
        else:
            result = asyncio.run(ours()) if IMPL == "asynctorchx" else theirs()
    finally:
        os.chdir("/")
        shutil.rmtree(WORKDIR, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
