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
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

IMPL, SCENARIO, PARAMS = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
PY = sys.executable


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
    "import sys\nn=int(sys.argv[1])\nw=sys.stdout.write\n"
    "for i in range(n): w(f'line {i:07d} ' + 'x'*40 + '\\n')\n"
)


# -- asynctorchx -------------------------------------------------------------------------------


async def ours() -> dict[str, Any]:
    from asynctorchx import AsyncRunner, specs

    sched = "local_cwd"
    async with AsyncRunner(name="bench") as runner:
        if SCENARIO == "fanout":
            n = PARAMS["n"]
            app = scenario_app(specs, "fan", "sh", ["-c", "exit 0"])
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
                t0 = time.perf_counter()
                count = 0
                async for _ in runner.log_lines(h, "main"):
                    count += 1
                return {"seconds": time.perf_counter() - t0, "lines": count}
            t0 = time.perf_counter()
            count = 0
            async for _ in runner.log_lines(h, "main", should_tail=True):
                count += 1
            return {"seconds": time.perf_counter() - t0, "lines": count}

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
            t0 = time.perf_counter()
            handles = [runner.run(app, sched) for _ in range(n)]
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
                handles.append(runner.run(app, sched))

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
            handles = [runner.run(app, sched) for _ in range(n)]
            time.sleep(0.5)
            c0, t0 = cpu_seconds(), time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(lambda h: runner.wait(h, wait_interval=0.1), handles))
            wall = time.perf_counter() - t0
            return {"cpu_percent": 100 * (cpu_seconds() - c0) / wall, "wall": wall}

        if SCENARIO == "tail":
            app = scenario_app(specs, "tail", PY, ["-u", "-c", TAIL_SCRIPT, str(PARAMS["lines"])])
            h = runner.run(app, sched)
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
            h = runner.run(app, sched)
            if SCENARIO == "read_finished":
                runner.wait(h, wait_interval=0.1)
                t0 = time.perf_counter()
                count = sum(1 for ln in runner.log_lines(h, "main") if ln)
                return {"seconds": time.perf_counter() - t0, "lines": count}
            t0 = time.perf_counter()
            count = sum(1 for ln in runner.log_lines(h, "main", should_tail=True) if ln)
            return {"seconds": time.perf_counter() - t0, "lines": count}

        if SCENARIO == "cancel":
            marker = str(random.randint(100000, 999999))
            app = scenario_app(
                specs, "stubborn", "sh", ["-c", f"trap '' TERM; sleep {marker} & sleep {marker}"]
            )
            h = runner.run(app, sched)
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


def main() -> None:
    os.chdir(tempfile.mkdtemp(prefix=f"cmp-{IMPL}-"))
    result = asyncio.run(ours()) if IMPL == "asynctorchx" else theirs()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
